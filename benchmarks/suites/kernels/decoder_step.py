"""What a model step costs the host: kvstrata's decoder (engine/decoder.py: about 11 kernels a layer, one Python
function) against transformers' own modules running the same weights over the same paged KV cache (about 45
kernels a layer; the engine's forward pass before the decoder). Both are timed on the same step inputs, in turn.

A step with few tokens is where the difference shows: a decode, or a question after a cached document. There
the work is small and the host's part (Python, and on a GPU the kernel launches) sets the time. Cases:

- decode: one sequence, one new token over `context` cached tokens;
- question: one sequence, 16 new tokens over `context` cached tokens (the long-document QA hit's step);
- decode x32: 32 sequences of one new token each over `context` cached tokens;
- chunk: 512 new tokens over `context` (a prefill chunk, where the arithmetic dominates).

Models: SmolLM2-135M (the embedded model), "thin-30", a random-weight model of SmolLM2's depth (30 layers) but
tiny widths, whose step is nearly all host work (the floor a step cannot go below), and on CUDA a
Llama-3-8B-shaped model with random weights. On a CPU: the torch path, one thread, best of `--repeats` by process
CPU time. On CUDA (`--device cuda`; the GPU report's `step` section): the Triton path, `triton.testing.do_bench`
medians, which include the time the GPU waits for the host's launches; and the cases a recorded size holds (the
decodes and the question) once more, replayed as CUDA graphs (engine/cuda_graphs.py, `model.cuda_graphs`).

    python benchmarks/kernels.py decoder-step --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.suites.kernels.paging import time_cpu, time_cuda  # noqa: E402  (best CPU time of a thread; do_bench median)
from benchmarks.lib.machine import machine_line  # noqa: E402
from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402

BLOCK_SIZE = 16
THIN_30 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
TRANSFORMERS_ATTENTION = "kvstrata-paged"


@dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    new: int


CASES = [Case("decode", 1, 1), Case("question", 1, 16), Case("decode x32", 32, 1), Case("chunk", 1, 512)]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, step_meta=None, **kwargs):
    """transformers' attention interface over the paged cache, as the engine ran it before engine/decoder.py:
    `query [1, H, T, D]`, `key/value [1, Hkv, T, D]` -> `([1, T, H, D], None)`."""
    meta, ops = step_meta
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    ops.store_kv(k, v, meta.kv_cache, module.layer_idx, meta.slot_mapping)
    out = ops.prefix_prefill(q, meta.kv_cache, module.layer_idx, meta.block_tables, meta.query_start_loc,
                             meta.seq_lens, scaling)
    return out.unsqueeze(0), None


def register_transformers_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TRANSFORMERS_ATTENTION, paged_attention)
    AttentionMaskInterface.register(TRANSFORMERS_ATTENTION, lambda *args, **kwargs: None)


def step_input(case: Case, context: int, vocab: int):
    """The case's step: each sequence's cached context in its own blocks, its new tokens after it."""
    from kvstrata.engine.model_runner import StepInput

    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-(context + case.new) // BLOCK_SIZE)
    ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
    for seq in range(case.num_seqs):
        table = list(range(seq * blocks_per_seq, (seq + 1) * blocks_per_seq))
        new_positions = list(range(context, context + case.new))
        ids += torch.randint(0, vocab, (case.new,), generator=gen).tolist()
        positions += new_positions
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new_positions]
        starts.append(len(ids))
        seq_lens.append(context + case.new)
        tables.append(table)
    last_rows = [s - 1 for s in starts[1:]]
    return StepInput(ids, positions, slots, tables, starts, seq_lens, last_rows), case.num_seqs * blocks_per_seq


class Paths:
    """The two forward passes over one runner's KV cache and step inputs."""

    def __init__(self, runner):
        self.runner = runner
        self.loaded = runner.loaded

    def decoder(self, step) -> torch.Tensor:
        return self.runner.execute(step)

    @torch.inference_mode()
    def transformers(self, step) -> torch.Tensor:
        from kvstrata.engine.decoder import AttentionMetadata

        runner, model = self.runner, self.loaded.model
        meta = AttentionMetadata(slot_mapping=runner._tensor(step.slot_mapping, torch.int64),
                                 block_tables=runner._tensor(step.block_tables, torch.int32),
                                 query_start_loc=runner._tensor(step.query_start_loc, torch.int32),
                                 seq_lens=runner._tensor(step.seq_lens, torch.int32), kv_cache=runner.kv_cache)
        body = model.get_decoder()
        hidden = body(input_ids=runner._tensor(step.input_ids, torch.int64)[None],
                      position_ids=runner._tensor(step.positions, torch.int64)[None], use_cache=False,
                      step_meta=(meta, runner.ops)).last_hidden_state[0]
        rows = hidden.index_select(0, runner._tensor(step.logits_indices, torch.int64))
        return model.get_output_embeddings()(rows).float()


def load(name: str, dtype: torch.dtype, device: str, work_dir: Path):
    from kvstrata.engine.model_loader import load_model, resolve_model

    if name == "thin-30":
        directory = work_dir / "thin-30"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(THIN_30))
        return load_model(resolve_model(str(directory), "dummy"), dtype, device)
    if name == "llama-3-8b":
        return load_model(resolve_model(name, "dummy"), dtype, device)
    return load_model(resolve_model(name), dtype, device, transformers_modules=True)  # its forward is compared


def measure_model(loaded, context: int, repeats: int, cases=CASES) -> list[dict]:
    """Each case's step through both paths, in turn, on a KV cache of its own holding random K/V."""
    from kvstrata.kernels.backends import get_ops, resolve_backend

    register_transformers_attention()
    model = loaded.model
    model.set_attn_implementation(TRANSFORMERS_ATTENTION)
    ops = get_ops(resolve_backend("auto", loaded.device))
    try:
        return [measure_case(loaded, ops, case, context, repeats) for case in cases]
    finally:
        model.set_attn_implementation("sdpa")


def measure_case(loaded, ops, case: Case, context: int, repeats: int) -> dict:
    from kvstrata.engine.model_runner import ModelRunner
    from kvstrata.tiers.base import BlockLayout

    cfg = loaded.model_config
    timer = time_cuda if loaded.device.type == "cuda" else time_cpu
    step, num_blocks = step_input(case, context, cfg.vocab_size)
    layout = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    kv_cache = layout.allocate(num_blocks, loaded.device)
    kv_cache.normal_()
    paths = Paths(ModelRunner(loaded, kv_cache, ops))
    runs = {"decoder": paths.decoder, "transformers": paths.transformers}
    if loaded.device.type == "cuda":  # a step a recorded size holds (decodes, a question): also replayed as a graph
        graphs = ModelRunner(loaded, kv_cache, ops)
        # one sequence more than the case's: a question's size holds a padding sequence beside it
        graphs.enable_cuda_graphs(case.num_seqs + 1, num_blocks // case.num_seqs, record=True)
        if graphs.replays(step):
            runs["graphs"] = graphs.execute
    agreement = check_agreement(runs, step, loaded.dtype)
    times = {path: [] for path in runs}
    for _ in range(2):  # in turn, twice: a drift of the machine shows as a spread, not as a ratio
        for path, seconds in timer({path: lambda run=run: run(step) for path, run in runs.items()}, repeats).items():
            times[path].append(seconds)
    best = {path: min(t) for path, t in times.items()}
    return {"case": case.name, "num_seqs": case.num_seqs, "new_tokens": case.new, "context": context,
            "decoder_s": best["decoder"], "transformers_s": best["transformers"], "graphs_s": best.get("graphs"),
            "speedup": best["transformers"] / best["decoder"], "runs_s": times, "agreement": agreement}


def check_agreement(runs: dict, step, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """How far each path's logits are from the decoder's on the same cache (a step rewrites only its own slots):
    the relative error `|a - b| / |b|` over the logits and the share of rows whose top token is the same.

    In float32 every path must agree (asserted). In bf16 or fp16 they need not, and are only measured: each
    rounds in its own places (fused kernels, packed products), and a random-normal cache of thousands of keys
    puts the model far from its training data, where 30 layers amplify rounding. On the embedded model over 64
    such keys the torch path's bf16 logits are 24% (in norm) from its float32 ones, the Triton path's 5%."""
    expected = runs["decoder"](step)
    agreement = {}
    for path, run in runs.items():
        got = run(step)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3, msg=lambda m: f"{path}: {m}")
        difference = (got.double() - expected.double()).norm() / expected.double().norm()
        same_top = (got.argmax(dim=-1) == expected.argmax(dim=-1)).double().mean()
        agreement[path] = {"relative_error": float(difference), "same_top_token": float(same_top)}
    return agreement


def markdown(result: dict) -> str:
    lines = ["# A model step: kvstrata's decoder against transformers' modules", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"Code: commit {result['commit']}; took {result['took_s']:.0f} s.", "",
             "Each step on one sequence's (or 32's) cached context, both forward passes over the same paged KV "
             "cache and inputs, in turn; best of the runs "
             f"({result['timing']}). Speed-up: transformers' time / the decoder's. CUDA graphs: the steps a recorded "
             "size holds (decodes and questions), replayed as graphs (CUDA only).", "",
             "| model | dtype | case | context | new tokens | transformers' modules | kvstrata decoder | speed-up "
             "| decoder, CUDA graphs | logits vs the decoder's |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for model in result["models"]:
        for row in model["rows"]:
            graphs = "–" if row.get("graphs_s") is None else f"{row['graphs_s'] * 1e3:.2f} ms"
            lines.append(f"| {model['model']} | {model['dtype']} | {row['case']} | {row['context']} | "
                         f"{row['num_seqs'] * row['new_tokens']} | {row['transformers_s'] * 1e3:.2f} ms | "
                         f"{row['decoder_s'] * 1e3:.2f} ms | {row['speedup']:.2f}x | {graphs} | "
                         f"{agreement_text(row)} |")
    return "\n".join(lines + ["", AGREEMENT_NOTE]) + "\n"


AGREEMENT_NOTE = ("Logits vs the decoder's: each other path's relative error over the step's logits "
                  "(|a - b| / |b|) and the share of rows with the same top token. Asserted in float32; in bf16 only "
                  "measured (`check_agreement`: rounding in other places, amplified by a random cache).")


def agreement_text(row: dict) -> str:
    """The other paths' agreement with the decoder, e.g. `transformers 2.1e-01 (100%)`."""
    others = {path: a for path, a in (row.get("agreement") or {}).items() if path != "decoder"}
    return "; ".join(f"{path} {a['relative_error']:.1e} ({a['same_top_token']:.0%})" for path, a in others.items()) \
        or "–"


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = options.parser(__doc__)
    options.device(parser, "cpu")
    parser.add_argument("--models", default="thin-30,smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=2048)
    options.repeats(parser, 10)
    options.out_dir(parser)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    started = time.perf_counter()
    result = {"models": []}
    with tempfile.TemporaryDirectory(prefix="kvstrata-step-") as work_dir:
        for name in args.models.split(","):
            for dtype_name in args.dtypes.split(","):
                loaded = load(name, getattr(torch, dtype_name), args.device, Path(work_dir))
                rows = measure_model(loaded, args.context, args.repeats)
                result["models"].append({"model": name, "dtype": dtype_name, "rows": rows})
                for row in rows:
                    print(f"{name} {dtype_name} {row['case']}: transformers {row['transformers_s'] * 1e3:.2f} ms, "
                          f"decoder {row['decoder_s'] * 1e3:.2f} ms ({row['speedup']:.2f}x)", flush=True)
                del loaded
    write_result(result, "decoder_step", argv, started,
                 "process CPU time, one thread" if args.device == "cpu" else "CUDA, do_bench medians", markdown,
                 args.out_dir)
    return 0


def write_result(result: dict, script: str, argv: list[str] | None, started: float, timing: str, markdown_of,
                 out_dir: Path | None) -> None:
    """Stamp `result` with the command (benchmarks/`script`.py and `argv`), the machine, the commit, the time taken
    since `started` and how steps were `timing`; print `markdown_of(result)` and, with `out_dir`, write it and the
    JSON there as `script`.md and `script`.json."""
    made = results.record(script)
    result.update(command=made["command"], machine=machine_line(), commit=made["source"]["commit"],
                  source=made["source"], took_s=time.perf_counter() - started, timing=timing)
    results.publish(result, markdown_of(result), out_dir, script)
