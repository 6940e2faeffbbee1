"""What the engine's own work costs the host at every decode step, outside the model: scheduling, building the
step's input, sampling, detokenizing, the block bookkeeping and the cost model's refit.

On a GPU this work is on the path of every token: the host does it between two model steps, and a small model's
decode step replayed as a CUDA graph (`model.cuda_graphs`) lasts a few milliseconds. Here the model is replaced
by a table of fixed random logits, so that nothing but the engine's own work is timed; the sampled tokens, and so
their text, still vary as a model's would. The model's vocabulary is cut to its first 2048 tokens: what the host
does with a row of logits on a GPU is launch kernels, whatever the row's width, while on a CPU the arithmetic over
49,152 logits (an argmax, a random draw per logit) would be timed as if it were host work.

Cases: how many sequences decode together, their prompt's length (a long document's keeps a long token list
beside every request), the answer's length (work that grows with it shows as a slower step at 1000 tokens), and
greedy or temperature 1.0 (an OpenAI client's default).

`--baseline REV` times the same cases on the engine of another commit (checked out in a temporary git worktree),
in turn with this one, and reports the ratios. Each side runs in a process of its own, best of `--repeats`.

    python benchmarks/host.py engine --baseline e24a1b0 --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.suites.kernels.decoder_step import THIN_30  # noqa: E402  (a 30-layer model of tiny widths, random weights)
from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402
from benchmarks.lib import in_turn  # noqa: E402
from benchmarks.lib import options  # noqa: E402

LOGIT_ROWS = 257  # rows of the fixed logits table; a prime, so that sequences do not fall into step
VOCAB = 2048      # the tokenizer's first tokens (see the module doc)


@dataclass(frozen=True)
class Case:
    num_seqs: int
    prompt_tokens: int
    answer_tokens: int
    temperature: float
    # requests queued behind the decoding ones (max_num_seqs is num_seqs), each a 2000-token prompt no tier holds,
    # with a CPU, a disk and a remote tier (a Valkey server on a loopback port): the scheduler orders them at every step
    waiting: int = 0
    # a device tier of this many blocks (0: the default size) and no limit on sequences: the waiting requests queue
    # for room on the device instead, and the first of them is tried at every step
    device_blocks: int = 0

    @property
    def name(self) -> str:
        sampling = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        queued = f", {self.waiting} more waiting, CPU, disk and remote tiers" if self.waiting else ""
        if self.device_blocks:
            queued += f", the device full ({self.device_blocks} blocks)"
        return (f"{self.num_seqs} x ({self.prompt_tokens}-token prompt, {self.answer_tokens}-token answer), "
                f"{sampling}{queued}")


CASES = [Case(1, 64, 1000, 0.0), Case(4, 64, 1000, 0.0), Case(4, 7000, 200, 0.0), Case(16, 2000, 200, 0.0),
         Case(16, 2000, 200, 1.0), Case(4, 64, 200, 0.0, waiting=16),
         # 4 x 17 blocks at most decoding: a waiting prompt's 125 blocks never fit beside them
         Case(4, 64, 200, 0.0, waiting=16, device_blocks=140), Case(4, 64, 200, 0.0, waiting=64, device_blocks=140)]
WAITING_PROMPT_TOKENS = 2000
STEP_LABEL = "engine_host.step"  # the profiler's label of a whole engine step


def build_engine(work_dir: Path, queue: Case | None = None, remote_url: str | None = None, cache: dict | None = None):
    """The engine on the thin model, its forward pass replaced by rows of a fixed logits table; for a `queue`
    case, with room for its decoding sequences only (sequence slots or device blocks), and lower tiers; else
    with the `cache` section given, if any."""
    import torch

    from kvstrata.engine.config import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    model_dir = work_dir / "thin-30"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**THIN_30, "vocab_size": VOCAB}))
    config = {"model": {"name": str(model_dir), "load_format": "dummy", "dtype": "float32", "device": "cpu"}}
    if queue is not None:
        config["cache"] = {"tiers": {"cpu": {"size": "256MiB"}, "disk": {"path": str(work_dir / "disk"),
                                                                          "size": "1GiB"},
                                     "remote": {"url": remote_url}}}
        if queue.device_blocks:
            config["cache"]["tiers"]["device"] = {"size": queue.device_blocks}
        else:
            config["scheduler"] = {"max_num_seqs": queue.num_seqs}
    elif cache is not None:
        config["cache"] = cache
    engine = LLMEngine(load_config(config))
    logits = torch.randn(LOGIT_ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    calls = iter(range(1 << 62))

    def execute(step) -> torch.Tensor:
        first = next(calls) * 7
        return logits[[(first + row) % LOGIT_ROWS for row in range(len(step.logits_indices))]]

    engine.runner.execute = execute
    return engine


def add_during_next_step(engine, add: Callable[[], object]) -> None:
    """Have `add` (which adds a request) run while the engine's next step computes, as the server adds a request
    that arrives then (`LLMEngine.take_arrivals`); an engine without that hook (a baseline from before it) runs it
    now, at the start of that step, which is where its server took such a request; so does an idle engine (no
    step computes: the request arrives between steps)."""
    if not hasattr(engine, "take_arrivals") or not engine.has_unfinished_requests():
        add()
        return

    def arrive() -> None:
        engine.take_arrivals = None
        add()
    engine.take_arrivals = arrive


def add_requests(engine, case: Case, tag: str) -> list[str]:
    from kvstrata.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=case.answer_tokens, temperature=case.temperature, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(case.num_seqs)]
    for i, request_id in enumerate(ids):  # distinct prompts: nothing is shared between the sequences
        engine.add_request(request_id, [100 + (i * 7919 + j) % (VOCAB - 100) for j in range(case.prompt_tokens)],
                           params)
    return ids


def finish(engine, ids: list[str]) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in ids:
        engine.release(request_id)


def add_waiting(engine, case: Case, tag: str) -> list[str]:
    from kvstrata.engine.sampling import SamplingParams

    ids = [f"{tag}-waiting-{i}" for i in range(case.waiting)]
    for i, request_id in enumerate(ids):  # salted by the tag: what an earlier run computed is no hit
        engine.add_request(request_id, [100 + (i * 104729 + j * 13) % (VOCAB - 100)
                                        for j in range(WAITING_PROMPT_TOKENS)], SamplingParams(max_tokens=1),
                           cache_salt=tag)
    return ids


def measure(engine, case: Case, tag: str) -> float:
    """Mean host seconds of the case's decode steps (every sequence has its first token; with its waiting
    requests queued behind them)."""
    ids = add_requests(engine, case, tag)
    while case.waiting and not all(engine.requests[r].output_token_ids for r in ids):
        engine.step()
    waiting = add_waiting(engine, case, tag)
    decode_s, decode_steps = 0.0, 0
    while engine.has_unfinished_requests():
        decoding = all(engine.requests[r].output_token_ids for r in ids) and not engine.requests[ids[0]].is_finished
        started = time.perf_counter()
        engine.step()
        if decoding:
            decode_s += time.perf_counter() - started
            decode_steps += 1
    finish(engine, ids + waiting)
    return decode_s / decode_steps


def count_ops(engine, case: Case, tag: str, steps: int = 16) -> float:
    """Tensor operations (outermost ATen calls on the step's thread) per decode step outside the model: on a GPU
    each launches a kernel or a copy, which costs the host several microseconds whatever its size."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ids = add_requests(engine, Case(case.num_seqs, case.prompt_tokens, steps + 4, case.temperature), tag)
    while not all(engine.requests[r].output_token_ids for r in ids):
        engine.step()
    waiting = add_waiting(engine, case, tag)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_LABEL):
                engine.step()
    finish(engine, ids + waiting)
    # the step's own: the tiers' threads (write-downs) run theirs beside it, off the step's path
    return sum(e.name.startswith("aten::") and e.cpu_parent is not None and e.cpu_parent.name == STEP_LABEL
               for e in prof.events()) / steps


def worker(cases: list[Case]) -> dict:
    """Every case once after a warm-up, in this process (whose `kvstrata` is the code under test)."""
    import torch

    import kvstrata.engine

    from tests.valkey_server import ValkeyServer

    torch.set_num_threads(1)
    seconds, ops = [], []
    with tempfile.TemporaryDirectory() as work_dir, ValkeyServer() as server:
        for n, case in enumerate(cases):
            # (a fresh engine per case: a queue case's tiers and sequence limit are its own)
            engine = build_engine(Path(work_dir) / f"case{n}", case if case.waiting else None, server.url)
            ops.append(count_ops(engine, case, f"ops{n}"))  # also the warm-up
            seconds.append(measure(engine, case, f"case{n}"))
            engine.close()
    return {"engine_code": list(kvstrata.engine.__path__)[0], "seconds": seconds, "ops": ops}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    options.in_turn(parser, "engine_host")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker([Case(**c) for c in json.loads(args.worker)])))
        return 0

    best: dict[str, list[float]] = {}
    ops: dict[str, list[float]] = {}
    cases_arg = json.dumps([asdict(c) for c in CASES])
    for repeat, side, measured in in_turn.each_side_in_turn(__file__, cases_arg, args.baseline, args.repeats):
        seconds, ops[side] = measured["seconds"], measured["ops"]
        best[side] = [min(pair) for pair in zip(best.get(side, seconds), seconds)]
        print(f"run {repeat + 1}, {side} ({measured['engine_code']}): "
              + ", ".join(f"{s * 1e3:.3f}" for s in seconds) + " ms", flush=True)
    cases = [{**asdict(case), "name": case.name, **{f"{side}_ms": best[side][n] * 1e3 for side in best},
              **{f"{side}_ops": ops[side][n] for side in ops}} for n, case in enumerate(CASES)]
    result = results.record("engine_host", baseline=args.baseline, repeats=args.repeats, cases=cases)
    results.publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline = result["baseline"]
    lines = ["# The engine's host work per decode step", "", *provenance_lines(result), "",
             "Mean wall time of one decode step with the model replaced by fixed logits (benchmarks/suites/host/engine.py: "
             f"the thin model's engine, one torch thread), best of {result['repeats']} runs of each side"
             + (f", this commit and {baseline} in turn." if baseline else "."), ""]
    if baseline:
        lines += [f"| case | {baseline} ms | this commit ms | {baseline} / this | tensor ops per step, {baseline} "
                  "| this commit |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {c['name']} | {c['baseline_ms']:.3f} | {c['this_ms']:.3f} | "
                  f"{c['baseline_ms'] / c['this_ms']:.2f}x | {c['baseline_ops']:g} | {c['this_ops']:g} |"
                  for c in result["cases"]]
    else:
        lines += ["| case | ms | tensor ops per step |", "|---|---:|---:|"]
        lines += [f"| {c['name']} | {c['this_ms']:.3f} | {c['this_ops']:g} |" for c in result["cases"]]
    lines += ["", "Tensor ops: the outermost ATen operations of a decode step outside the model, on the step's thread "
              "(torch's profiler, 16 steps): on a GPU each launches a kernel or a copy."]
    return lines
