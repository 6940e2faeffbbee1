"""The CPU report: kvstrata beside vLLM on this CPU, every goal of the CPU-speed issue met or not, in one command.

    make cpu-report                                           # = python benchmarks/ttft.py cpu-report
    python benchmarks/ttft.py cpu-report --parts tests,one_thread   # some parts; the others kept from earlier runs
    python benchmarks/ttft.py cpu-report --dry-run            # the parts' commands, nothing run

Its goals are the issue's, side by side with vLLM in one run, on one thread and on all of them: a miss's TTFT and a
decoded token at most 1.1x vLLM's and a device hit at most vLLM's, in float32 and bfloat16; under guidellm, output
throughput at least vLLM's and TTFT median and p95 at most vLLM's; under pressure and after a restart, our tiers still
ahead; and the batch-invariant mode at most 1.5x the default mode's time.

Parts, in the order they run (all by default; `--parts` picks some), each a benchmark of its own in a process of its
own, whose report and JSON land beside this one as `<name>_<part>`:

- tests: the compiled CPU kernels' tests (`tests/test_kernels_cpu_*.py` and the CPU-feature checks): each kernel
  built for this CPU's instruction set against its torch reference, bit for bit where the kernels promise it.
- one_thread, all_threads: `ttft.py vllm` (a miss, a device hit, decode per token; float32 and bfloat16), one thread
  each, then every core (skipped on one core).
- guidellm: `ttft.py concurrency --guidellm kvstrata,vllm`: both OpenAI servers under guidellm, 1 GiB of KV cache
  each (so that vLLM's holds every shared prefix).
- pressure: `ttft.py pressure --peers vllm,hf_generate`, cut so that vLLM's four processes fit one run:
  recompute, prefix caching in our device tier's bytes, a cache for everything, and after a restart; transformers'
  `generate` (the floor) on the same requests.
- invariant_mode: `invariance.py batch cost`: a 2,048-token prefill and a decode step in both modes.

The report (`<name>.md` and `.json`, `<name>` by default `cpu_report_<family>`, the family being `amx`, `avx512`,
`avx2` or `portable`) is written after every part from every part's JSON present, so a run can be made in several
sittings and a part stopped midway keeps the others; each part's row names its own commit. Where vLLM cannot run
(no wheel for this CPU, or its process fails), its parts say why in one line, and the goals of a miss, a decoded
token, a device hit, pressure and restart are held against transformers' `generate` with `attn_implementation=
"sdpa"` instead, the floor (each such goal says so); guidellm's, which need a server beside ours, read N/A.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.lib import options, results
from benchmarks.lib.child_runs import junit_counts, run_until
from benchmarks.lib.machine import REPO_ROOT, machine_line
from benchmarks.lib.ttft_stats import Goal

MAX_RATIO = 1.1         # a miss and a decoded token: at most this much of vLLM's time
INVARIANT_MAX_COST = 1.5  # the batch-invariant mode against the default mode
KERNEL_TESTS = ("tests/test_kernels_cpu_attention.py", "tests/test_kernels_cpu_layer_ops.py",
                "tests/test_kernels_cpu_linear.py", "tests/test_kernels_cpu_threads.py", "tests/test_cpu_features.py",
                "tests/test_kernels_batch_invariant.py")
PART_TIMEOUT_S = 3 * 3600
# said in a goal's name when it was held against the floor: vLLM did not run (its part's report says why)
FLOOR_SAYS = " (against transformers' generate, sdpa: vLLM did not run)"


def cpu_family() -> str:
    """'amx', 'avx512', 'avx2' or 'portable': the widest unit this CPU's products may use (kernels/cpu_features.py)."""
    from kvstrata.kernels import cpu_features

    isa = cpu_features.kernel_isa()
    return "amx" if cpu_features.cpu_matrix_family() == "amx" else isa


@dataclass(frozen=True)
class Part:
    name: str
    goals: Callable[[dict], list[Goal]]  # from the part's JSON
    # its command's arguments after `python`, given the folder and the file stem its results go to (None: the
    # kernels' tests, which this process runs and writes up itself, `run_tests`)
    arguments: Callable[[str, str], list[str]] | None = None


def _vllm_side_by_side(threads: int) -> Callable[[str, str], list[str]]:
    return lambda out_dir, stem: ["benchmarks/ttft.py", "vllm", "--dtype", "float32", "bfloat16", "--docs", "2",
                                  "--decode-tokens", "64", "--threads", str(threads), "--out-dir", out_dir,
                                  "--name", stem]


def side_by_side_goals(result: dict) -> list[Goal]:
    """`ttft.py vllm`'s result: per dtype, a miss, a decoded token and a device hit, ours / vLLM's medians."""
    from benchmarks.suites.ttft.vllm import THEIRS, peer_of, ratios

    goals = []
    for run in result["runs"]:
        measured = ratios(run) or {}
        peer = peer_of(run)
        theirs = THEIRS.get(peer, "vLLM's")
        where = f"{result['threads']} thread(s), {run['dtype']}" + (FLOOR_SAYS if peer == "transformers" else "")
        goals += [Goal(f"{where}: a miss's TTFT", measured.get("miss_s"), MAX_RATIO, "<=", "ours", theirs),
                  Goal(f"{where}: a decoded token", measured.get("decode_s_per_token"), MAX_RATIO, "<=", "ours",
                       theirs),
                  Goal(f"{where}: a device hit's TTFT", measured.get("hit_s"), 1.0, "<=", "ours", theirs)]
    return goals


def guidellm_goals(result: dict) -> list[Goal]:
    """`ttft.py concurrency --guidellm`'s own goals (throughput, TTFT median and p95, ours / vLLM's)."""
    return [Goal(f"guidellm: {g['name']}", g["value"], g["target"], g["direction"], "ours", "vLLM's")
            for g in result.get("goals", [])]


@dataclass(frozen=True)
class PressureGoal:
    key: str                  # in `headline_ratios` and `floor_ratios`
    measures: str
    target: float
    direction: str
    against_vllm: str = ""    # what ours is divided by, where it needs saying
    against_floor: str = ""


PRESSURE_GOALS = (
    PressureGoal("pressure", "TTFT p50, our device + CPU tiers", 1.0, "<",
                 "vLLM's prefix caching in the same bytes", "every prompt prefilled"),
    PressureGoal("restart", "TTFT p50 after a restart, our disk tier", 1.0, "<", "a new vLLM process",
                 "every prompt prefilled"),
    PressureGoal("miss", "a miss (recompute p50)", MAX_RATIO, "<="),
    PressureGoal("device_hit", "a device hit (p50)", 1.0, "<="),
)


def pressure_goals(result: dict) -> list[Goal]:
    """The pressure suite's rows beside vLLM's (benchmarks/lib/vllm_pressure.py `headline_ratios`), or beside the
    floor's where vLLM's did not run (`floor_ratios`)."""
    from benchmarks.lib.vllm_pressure import floor_ratios, headline_ratios

    ratio, on_floor = headline_ratios(result), False
    if all(value is None for value in ratio.values()) and (floor := floor_ratios(result)) is not None:
        ratio, on_floor = floor, True
    goals = []
    for g in PRESSURE_GOALS:
        against = g.against_floor if on_floor else g.against_vllm
        name = f"pressure{FLOOR_SAYS if on_floor else ''}: {g.measures}" + (f" / {against}" if against else "")
        goals.append(Goal(name, ratio[g.key], g.target, g.direction, "ours", "transformers'" if on_floor else "vLLM's"))
    return goals


def invariant_mode_goals(result: dict) -> list[Goal]:
    """`invariance.py batch cost`'s result: per dtype, the invariant mode's prefill and decode step against the
    default mode's."""
    goals = []
    for run in result["runs"]:
        goals += [Goal(f"batch-invariant mode, {run['dtype']}: a {run['prompt_tokens']}-token prefill",
                       run["ttft_ratio"], INVARIANT_MAX_COST, "<=", "invariant", "default"),
                  Goal(f"batch-invariant mode, {run['dtype']}: a decode step", run["step_ratio"], INVARIANT_MAX_COST,
                       "<=", "invariant", "default")]
    return goals


def tests_goals(result: dict) -> list[Goal]:
    return [Goal(f"compiled CPU kernels' tests: failed or errors (of {result['passed']} passed, {result['skipped']} "
                 "skipped)", result["failed"] + result["errors"], 0, "<=", "tests", "")]


PARTS = (
    Part("tests", tests_goals),
    Part("one_thread", side_by_side_goals, _vllm_side_by_side(1)),
    Part("all_threads", side_by_side_goals, _vllm_side_by_side(os.cpu_count() or 1)),
    Part("guidellm", guidellm_goals,
         lambda out_dir, stem: ["benchmarks/ttft.py", "concurrency", "--guidellm", "kvstrata,vllm", "--kv-cache-mib",
                                "1024", "--out-dir", out_dir, "--name", stem]),
    Part("pressure", pressure_goals,
         lambda out_dir, stem: ["benchmarks/ttft.py", "pressure", "--config", "configs/pressure.yaml", "--threads",
                                "1", "--peers", "vllm,hf_generate", "--questions", "2", "--zipf-requests", "4",
                                "--cold-pairs", "0", "--sweep-fractions", "", "--no-profile", "--no-plots", "--out-dir",
                                out_dir, "--name", stem]),
    Part("invariant_mode", invariant_mode_goals,
         lambda out_dir, stem: ["benchmarks/invariance.py", "batch", "cost", "--length", "2048", "--backend", "auto",
                                "--out-dir", out_dir, "--name", stem]),
)
PART_NAMES = tuple(p.name for p in PARTS)


def parse_args(argv: list[str] | None):
    p = options.parser(__doc__)
    p.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma separated, some of {', '.join(PART_NAMES)}")
    p.add_argument("--part-timeout", type=float, default=PART_TIMEOUT_S, help="seconds a part may run before it is "
                   "stopped (its goals then read from whatever it wrote)")
    p.add_argument("--dry-run", action="store_true", help="print each part's command; run nothing")
    options.out_dir(p, str(REPO_ROOT / "benchmarks" / "results"))
    options.name(p, None, help="stem of the report's files (default: cpu_report_<family>)")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in args.parts if s not in PART_NAMES]
    if unknown or not args.parts:
        p.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; choose among {', '.join(PART_NAMES)}")
    return args


def part_stem(name: str, part: str) -> str:
    return f"{name}_{part}"


def tests_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]


def part_command(part: Part, out_dir: str, stem: str) -> list[str]:
    return tests_command() if part.arguments is None else [sys.executable, *part.arguments(out_dir, stem)]


def skipped_why(part: Part) -> str | None:
    if part.name == "all_threads" and (os.cpu_count() or 1) < 2:
        return "one core: the one-thread part is all threads"
    return None


def run_tests(out_dir: str, stem: str, timeout_s: float) -> int:
    """The kernels' tests in a child pytest; their counts written as the part's result."""
    with tempfile.TemporaryDirectory(prefix="kvstrata-cpu-tests-") as tmp:
        junit = Path(tmp) / "tests.xml"
        command = tests_command() + [f"--junitxml={junit}"]
        run = run_until(command, dict(os.environ), time.time() + timeout_s, on_line=print, cwd=REPO_ROOT)
        counts = junit_counts(junit) if junit.exists() else None
    if counts is None:
        print(f"tests: pytest wrote no results (exit status {run.returncode})", flush=True)
        return run.returncode or 1
    result = {**results.record(stem, **counts, returncode=run.returncode, tests=list(KERNEL_TESTS)),
              "command": shlex.join(["python", *command[1:-1]])}  # what ran, without the scratch JUnit file
    lines = ["# The compiled CPU kernels' tests", "",
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} "
             f"skipped: `pytest {' '.join(KERNEL_TESTS)}`"]
    lines += [f"- {test}: {counts['why'][test]}" for test in counts["not_passed"]]
    results.write(out_dir, result, lines, stem)
    return run.returncode


def read_part(out_dir: str, stem: str) -> dict | None:
    path = Path(out_dir) / f"{stem}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(out_dir: str, name: str, family: str, runs: dict[str, dict]) -> tuple[dict, list[str]]:
    """The report from every part's JSON present in `out_dir` (this run's and earlier ones'): each goal met or not,
    and each part's command and commit."""
    goals: list[dict] = []
    parts: dict[str, dict] = {}
    for part in PARTS:
        stem = part_stem(name, part.name)
        found = read_part(out_dir, stem)
        state = {"file": f"{stem}.md" if found is not None else None, **runs.get(part.name, {})}
        if found is None:
            ran = state.get("status")
            state["status"] = "not run" if ran is None else ran if ran.startswith("skipped") else \
                f"{ran}; it wrote no results"
        else:
            state.update(command=found.get("command"), commit=(found.get("source") or {}).get("commit"))
            state.setdefault("status", "kept from an earlier run")
            try:
                goals += [{"part": part.name, **g.as_dict()} for g in part.goals(found)]
            except (KeyError, TypeError, ValueError) as e:
                state["status"] += f"; its figures could not be read ({type(e).__name__}: {e})"
        parts[part.name] = state
    result = results.record(name, family=family, parts=parts, goals=goals)
    return result, report_lines(result)


MET = {"PASS": "yes", "MISS": "no", "N/A": "N/A"}


def _value(goal: dict) -> str:
    if goal["value"] is None:
        return "–"
    return str(int(goal["value"])) if goal["part"] == "tests" else f"{goal['value']:.2f}x"


def report_lines(result: dict) -> list[str]:
    met = sum(g["status"] == "PASS" for g in result["goals"])
    measured = sum(g["status"] != "N/A" for g in result["goals"])
    lines = [f"# kvstrata beside vLLM on this CPU ({result['family']})", "",
             f"{met} of {measured} goals measured are met ({len(result['goals']) - measured} not measured). Every "
             "ratio is ours / vLLM's (the invariant mode: against the default mode; a goal that says so: against "
             "transformers' generate with sdpa, the floor where vLLM did not run), measured side by side in one "
             "run of its part.", "", "## Goals", "", "| part | goal | measured | target | met |",
             "|---|---|---:|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['part']} | {g['name']} | {_value(g)} | {g['direction']} {g['target']} | "
                     f"{MET[g['status']]} |")
    lines += ["", "## Parts", "", "| part | status | commit | command | report |", "|---|---|---|---|---|"]
    for part, state in result["parts"].items():
        command = state.get("command")
        report = f"[{state['file']}]({state['file']})" if state["file"] else "–"
        lines.append(f"| {part} | {state['status']} | {state.get('commit') or '–'} | "
                     f"{f'`{command}`' if command else '–'} | {report} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    family = cpu_family()
    name = args.name or f"cpu_report_{family}"
    out_dir = str(Path(args.out_dir).resolve())
    chosen = [p for p in PARTS if p.name in args.parts]
    if args.dry_run:
        for part in chosen:
            why = skipped_why(part)
            print(f"{part.name}: " + (f"skipped ({why})" if why else
                                      shlex.join(part_command(part, out_dir, part_stem(name, part.name)))))
        return 0
    print(f"CPU family {family}; {machine_line()}", flush=True)
    runs: dict[str, dict] = {}
    for part in chosen:
        stem = part_stem(name, part.name)
        why = skipped_why(part)
        if why:
            runs[part.name] = {"status": f"skipped: {why}"}
            continue
        print(f"--- {part.name}: {shlex.join(part_command(part, out_dir, stem))}", flush=True)
        started = time.perf_counter()
        if part.arguments is None:
            returncode = run_tests(out_dir, stem, args.part_timeout)
        else:
            returncode = run_until(part_command(part, out_dir, stem), dict(os.environ),
                                   time.time() + args.part_timeout, on_line=print, cwd=REPO_ROOT).returncode
        runs[part.name] = {"status": "ran" if returncode == 0 else f"exited with status {returncode}",
                           "seconds": round(time.perf_counter() - started, 1)}
        if part is not chosen[-1]:  # after every part: a run stopped midway keeps what the others measured
            results.write(out_dir, *summarize(out_dir, name, family, runs), name)
    result, lines = summarize(out_dir, name, family, runs)
    results.write(out_dir, result, lines, name)
    print("\n".join(lines))
    return 0 if all(g["status"] != "MISS" for g in result["goals"]) else 1
