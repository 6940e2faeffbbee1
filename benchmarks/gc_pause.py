"""What a full collection of Python's cyclic garbage collector costs a serving engine: the pause, with the objects
that exist at the engine's start frozen out of full collections (as the engine does) and with them walked (as
before), side by side in one process.

The collector runs a full collection on its own now and then, in whichever thread allocates at that moment: on the
step thread it is a pause of the step, which every running request waits for. Its cost grows with the objects it
walks: the model's modules and parameters, the tokenizer, the tiers.

    python benchmarks/gc_pause.py [--out-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import provenance_lines, publish, results_record  # noqa: E402

REPEATS = 7


def full_collection_s() -> float:
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def measure() -> dict:
    from pydoc_data.topics import topics

    from kvstrata import LLM, SamplingParams

    with LLM({"model": {"device": "cpu", "dtype": "float32"}}) as llm:  # the embedded model, default tiers
        documents = [topics[name][:4000] for name in ("assignment", "class", "exceptions", "import")]
        llm.generate([d + "\nWhat is this about?" for d in documents], SamplingParams(max_tokens=8))  # cached
        frozen_objects, walked_objects = gc.get_freeze_count(), len(gc.get_objects())
        frozen, walked = [], []
        for _ in range(REPEATS):  # in turn: frozen as the engine left them, then all of them walked
            frozen.append(full_collection_s())
            gc.unfreeze()
            walked.append(full_collection_s())
            gc.freeze()
    return {"frozen_objects": frozen_objects, "walked_objects": walked_objects,
            "frozen_s": statistics.median(frozen), "walked_s": statistics.median(walked),
            "frozen_runs_s": frozen, "walked_runs_s": walked}


def report(result: dict) -> list[str]:
    f = result["figures"]
    return ["# A full garbage collection in a serving engine", "", *provenance_lines(result), "",
            f"`gc.collect()` in a process serving the embedded model (float32, default tiers) after four questions on "
            f"four documents (about 1000 tokens each, now cached): median of {REPEATS}, in turn.", "",
            "| objects | walked by a full collection | pause ms |", "|---|---:|---:|",
            f"| the engine's start-up objects frozen (kvstrata) | {f['walked_objects']:,} | {f['frozen_s'] * 1e3:.2f} |",
            f"| all walked (before) | {f['walked_objects'] + f['frozen_objects']:,} | {f['walked_s'] * 1e3:.2f} |",
            ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", help="write gc_pause.md and .json there")
    args = parser.parse_args(argv)
    result = results_record("gc_pause", figures=measure())
    publish(result, report(result), args.out_dir)


if __name__ == "__main__":
    main()
