"""What a request's output snapshot costs the engine thread: `RequestOutput.from_request`, which `AsyncEngine` calls
for every running request at every step (a streamed answer's next text, or the answer a non-streaming caller waits
for), for requests with log-probabilities over a long prompt.

Cases: a 7000-token prompt whose log-probabilities were asked for (`prompt_logprobs`, an evaluation's scoring), and
a generated answer's log-probabilities (`logprobs`) at its 100th and 2000th token. The entries are made up, with
the alternatives the engine keeps (`MAX_LOGPROBS`); the figure is the mean time of one snapshot.

    python benchmarks/output_snapshot.py --baseline REV --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable, after
    sys.path.append(str(REPO_ROOT))  # PYTHONPATH, where a baseline's `kvstrata` comes first (see --baseline)

from benchmarks.engine_host import each_side_in_turn, in_turn_parser  # noqa: E402
from benchmarks.machine import provenance_lines, publish, results_record  # noqa: E402

SNAPSHOTS = 200  # timed per case, after as many untimed


@dataclass(frozen=True)
class Case:
    prompt_tokens: int
    prompt_logprobs: int | None  # alternatives asked for the prompt's entries (None: none)
    answer_tokens: int
    logprobs: int | None         # alternatives asked for the answer's entries (None: none)

    @property
    def name(self) -> str:
        prompt = f"{self.prompt_tokens}-token prompt" + (
            f" with prompt_logprobs={self.prompt_logprobs}" if self.prompt_logprobs is not None else "")
        answer = f"at answer token {self.answer_tokens}" + (
            f", logprobs={self.logprobs}" if self.logprobs is not None else "")
        return f"{prompt}, {answer}"


CASES = [Case(7000, None, 100, None), Case(7000, 5, 100, None), Case(7000, None, 100, 5), Case(7000, None, 2000, 5)]


def request_of(case: Case):
    """A running request as the engine leaves it after `case.answer_tokens` tokens."""
    from kvstrata.engine.request import Request
    from kvstrata.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs

    def entry(token_id: int) -> TokenLogprobs:
        return TokenLogprobs(token_id, -1.0 - token_id % 7 / 8,
                             tuple((token_id + k, -1.0 - k / 8) for k in range(MAX_LOGPROBS)), 1)

    params = SamplingParams(max_tokens=case.answer_tokens + 10, logprobs=case.logprobs,
                            prompt_logprobs=case.prompt_logprobs)
    request = Request("r", [100 + t % 1000 for t in range(case.prompt_tokens)], params)
    if case.prompt_logprobs is not None:
        request.prompt_logprobs = [entry(t) for t in request.prompt_token_ids[1:]]
    for k in range(case.answer_tokens):
        request.output_token_ids.append(200 + k % 500)
        if case.logprobs is not None:
            if hasattr(request, "append_logprobs"):
                request.append_logprobs(entry(200 + k % 500))
            else:  # (an older engine)
                request.output_logprobs.append(entry(200 + k % 500))
    request.output_text = "x" * case.answer_tokens
    return request


def worker(cases: list[Case]) -> dict:
    """Each case's mean snapshot time, in this process (whose `kvstrata` is the code under test)."""
    import kvstrata.engine
    from kvstrata.engine.llm import RequestOutput

    seconds = []
    for case in cases:
        request = request_of(case)
        for _ in range(SNAPSHOTS):
            RequestOutput.from_request(request)
        started = time.perf_counter()
        for _ in range(SNAPSHOTS):
            RequestOutput.from_request(request)
        seconds.append((time.perf_counter() - started) / SNAPSHOTS)
    return {"engine_code": str(Path(kvstrata.engine.__file__).parent), "seconds": seconds}


def main() -> int:
    args = in_turn_parser(__doc__, "output_snapshot").parse_args()
    if args.worker:
        print(json.dumps(worker([Case(**c) for c in json.loads(args.worker)])))
        return 0

    best: dict[str, list[float]] = {}
    for repeat, side, measured in each_side_in_turn(__file__, json.dumps([asdict(c) for c in CASES]), args.baseline,
                                                    args.repeats):
        seconds = measured["seconds"]
        best[side] = [min(pair) for pair in zip(best.get(side, seconds), seconds)]
        print(f"run {repeat + 1}, {side} ({measured['engine_code']}): "
              + ", ".join(f"{s * 1e6:.1f}" for s in seconds) + " us", flush=True)
    cases = [{**asdict(case), "name": case.name, **{f"{side}_us": best[side][n] * 1e6 for side in best}}
             for n, case in enumerate(CASES)]
    result = results_record("output_snapshot", baseline=args.baseline, repeats=args.repeats, cases=cases)
    publish(result, report(result), args.out_dir)
    return 0


def report(result: dict) -> list[str]:
    baseline = result["baseline"]
    lines = ["# What a request's output snapshot costs", "", *provenance_lines(result), "",
             "Mean time of one `RequestOutput.from_request` (what `AsyncEngine` builds for each running request at "
             f"every step), {SNAPSHOTS} timed after {SNAPSHOTS} untimed; best of {result['repeats']} runs of each "
             "side" + (f", this commit and {baseline} in turn." if baseline else "."), ""]
    if baseline:
        lines += [f"| case | {baseline} us | this commit us | {baseline} / this |", "|---|---:|---:|---:|"]
        lines += [f"| {c['name']} | {c['baseline_us']:.1f} | {c['this_us']:.1f} | "
                  f"{c['baseline_us'] / c['this_us']:.2f}x |" for c in result["cases"]]
    else:
        lines += ["| case | us |", "|---|---:|"]
        lines += [f"| {c['name']} | {c['this_us']:.1f} |" for c in result["cases"]]
    return lines


if __name__ == "__main__":
    sys.exit(main())
