"""How long the embedded model takes to load at start: read from its GGUF (every start before the converted copy,
engine/converted_model.py), on a first start that converts it and keeps the copy, and on a later start that reads
the copy.

Each load runs in a process of its own (as a start does: nothing imported, nothing cached in memory), the three kinds
in turn for `--rounds` rounds, each with a cache directory of its own (`KVSTRATA_CACHE_DIR`): for "GGUF", one that
cannot be written (no copy is kept, as before); for "first start", an empty one; for "later start", one a first
start filled. Timed: `load_model` in the process, and the process from launch to exit (the imports included).

    python benchmarks/host.py startup --rounds 3 --out-dir benchmarks/results
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib import options  # noqa: E402
from benchmarks.lib import results  # noqa: E402
from benchmarks.lib.machine import provenance_lines  # noqa: E402

SHORT = {"gguf": "GGUF", "first": "first start", "later": "later start"}
KINDS = {"gguf": "GGUF (no copy kept)", "first": "first start (converts, keeps the copy)",
         "later": "later start (reads the copy)"}
LOAD = """
import json, sys, time
started = time.perf_counter()
import torch
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model
imported = time.perf_counter()
loaded = load_model(resolve_model(EMBEDDED_MODEL), getattr(torch, sys.argv[1]), "cpu")
print(json.dumps({"import_s": imported - started, "load_s": time.perf_counter() - imported,
                  "identity": loaded.model_config.identity, "weights_in": type(loaded.model).__name__}))
"""


def load_once(cache_dir: Path, dtype: str) -> dict:
    """One start in a process of its own with `cache_dir` as its cache: its figures, and its wall time."""
    env = {**os.environ, "KVSTRATA_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LOAD, dtype], env=env, capture_output=True, text=True, timeout=600)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"startup: a load failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def measure(rounds: int, dtype: str, kinds: tuple[str, ...] = tuple(KINDS)) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as work:
        unwritable = Path(work) / "a-file"
        unwritable.write_text("")
        for r in range(rounds):
            first = Path(work) / f"first-{r}"
            if "gguf" in kinds:
                runs["gguf"].append(load_once(unwritable / "cache", dtype))  # a cache under a file: nothing is kept
            if "first" in kinds or "later" in kinds:  # a later start needs the copy a first start keeps
                first_run = load_once(first, dtype)
                if "first" in kinds:
                    runs["first"].append(first_run)
                if "later" in kinds:
                    runs["later"].append(load_once(first, dtype))
                shutil.rmtree(first)
    identities = {run["identity"] for kind_runs in runs.values() for run in kind_runs}
    if len(identities) != 1:
        raise SystemExit(f"startup: the loads named other models: {sorted(identities)}")
    return runs


def report(result: dict) -> list[str]:
    runs = result["runs"]
    median = {kind: {key: statistics.median(r[key] for r in kind_runs) for key in ("load_s", "wall_s")}
              for kind, kind_runs in runs.items()}
    base = next(iter(median))  # the ratios are against the first kind measured: the GGUF's load when it is
    lines = ["# Loading the embedded model at start", "", *provenance_lines(result), "",
             f"SmolLM2-135M (the embedded GGUF) in {result['dtype']} on the CPU, each load in a process of its own, "
             f"the three kinds in turn, {result['rounds']} rounds (benchmarks/suites/host/startup.py); medians, every run in "
             "`startup.json`.", "",
             f"| start | load_model s | process s (imports included) | {SHORT[base]} / this (load_model) |",
             "|---|---:|---:|---:|"]
    for kind, m in median.items():
        lines.append(f"| {KINDS[kind]} | {m['load_s']:.2f} | {m['wall_s']:.2f} | "
                     f"{median[base]['load_s'] / m['load_s']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    options.dtype(parser, "float32")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma separated, of {', '.join(KINDS)} (a later start is timed after a first one)")
    options.out_dir(parser)
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: expected some of {', '.join(KINDS)}, got {args.kinds!r}")
    result = results.record("startup", dtype=args.dtype, rounds=args.rounds,
                            runs=measure(args.rounds, args.dtype, kinds))
    results.publish(result, report(result), args.out_dir)
    return 0
