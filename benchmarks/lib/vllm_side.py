"""vLLM's side of a peer comparison: run by the peer's own Python (its venv, benchmarks/lib/peers.py `VLLMPeer`),
never imported by kvstrata. It loads vLLM's offline `LLM` on a model folder and answers requests read as JSON lines
on stdin, one JSON line on stdout each, prefixed with `REPLY_PREFIX` (vLLM logs to stdout too):

    {"token_ids": [...], "max_tokens": 1}  ->  {"seconds": wall time of the generate call, "token_ids": [...]}
    {"reset_prefix_cache": true}           ->  {"reset": true}

`seconds` is what the caller sees: the time `LLM.generate` takes for one prompt (for `max_tokens=1`, its TTFT).
Greedy, `ignore_eos`, prefix caching on (`--no-prefix-caching`: off, every prompt computed in full).

vLLM spawns its engine process, which would run a script's top level again (a script needs a guard on `__name__`
for it): the peer runs this file's text with `python -c` and a call of `main()`
(`command`), and a `-c` program is never run again in a spawned child.
"""
import argparse
import json
import sys
import time
from pathlib import Path

REPLY_PREFIX = "KVSTRATA-PEER "


def reply(payload: dict) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-bytes", type=int, required=True)
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_bytes,
              enable_prefix_caching=args.prefix_caching, seed=0)
    import torch

    cache = llm.llm_engine.vllm_config.cache_config
    reply({"ready": True, "start_s": time.perf_counter() - started, "vllm": vllm.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "block_size": cache.block_size, "prefix_caching": bool(cache.enable_prefix_caching)})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
            reply({"reset": True})
            continue
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": request["token_ids"]}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        reply({"seconds": seconds, "token_ids": list(out[0].outputs[0].token_ids),
               "cached_tokens": out[0].num_cached_tokens})


def command(python: str, *args: str) -> list[str]:
    """The command line that runs `main()` with `args` in the interpreter `python` (the peer's)."""
    return [python, "-c", Path(__file__).read_text() + "\nmain()\n", *args]
