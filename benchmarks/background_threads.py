"""What work on another thread of the server's process costs a cache hit's TTFT.

The engine steps on one thread; the HTTP server, the tokenizer pool, the transfer workers, the disk
writer and the KV-event publisher run on others in the same process. Work in native code (copies,
LMDB, checksums) releases Python's interpreter lock; pure Python holds it, and the step thread, which
takes the lock back after every torch operation, waits up to the interpreter's switch interval each
time. Measured side by side in one run, on the embedded model (float32, one torch thread): a 16-token
question over a 2k-token document cached on the device, alone and beside a thread that runs

- `disk put`: the disk tier's put and flush of 128 blocks (record copy, checksum, LMDB commit), in a loop;
- `memcpy`: numpy copies of the same bytes, in a loop (memory bandwidth only);
- `python`: a pure-Python loop (the interpreter lock held between switches);

at the default switch interval (5 ms) and at shorter ones. Run:

    python benchmarks/background_threads.py   # prints the table, writes benchmarks/results/background_threads.{md,json}
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.machine import provenance_lines, results_record, write_results  # noqa: E402

BLOCKS_PER_PUT = 128  # one 2k-token document


def background_work(kind: str, llm, store_dir: str, stop: threading.Event):
    """A function looping over `kind`'s work until `stop` is set."""
    import numpy as np
    import torch

    from kvstrata.tiers.disk import DiskTier

    layout = llm.engine.layout
    nbytes = layout.block_nbytes
    if kind == "disk put":
        disk = DiskTier(layout, os.path.join(store_dir, "kv"), 4 << 30)
        payloads = [torch.from_numpy(np.random.randint(0, 255, nbytes, dtype=np.uint8)) for _ in range(BLOCKS_PER_PUT)]
        tokens = [tuple(range(layout.block_size))] * BLOCKS_PER_PUT

        def work():
            while not stop.is_set():
                disk.put([os.urandom(16) for _ in range(BLOCKS_PER_PUT)], tokens, payloads)
                disk.flush()
            disk.close()
        return work
    if kind == "memcpy":
        source = np.random.randint(0, 255, BLOCKS_PER_PUT * nbytes, dtype=np.uint8)
        dest = np.empty_like(source)

        def work():
            while not stop.is_set():
                np.copyto(dest, source)
        return work
    assert kind == "python"

    def work():
        while not stop.is_set():
            total = 0
            for i in range(10_000):
                total += i
    return work


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals-ms", default="5,1,0.5,0.1", help="interpreter switch intervals, comma separated")
    p.add_argument("--kinds", default="disk put,memcpy,python")
    p.add_argument("--hits", type=int, default=5, help="hits timed per cell")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pydoc_data.topics import topics

    from kvstrata import LLM, SamplingParams

    llm = LLM({"model": {"device": "cpu", "dtype": "float32", "threads": 1},
               "cache": {"tiers": {"device": {"size": 600}, "cpu": {"size": 0}, "disk": {"size": 0}}}})
    tokenizer = llm.tokenizer
    document = tokenizer.encode(" ".join(topics[k] for k in sorted(topics)[:40]))[:args.doc_tokens]
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    questions = iter(range(1_000_000))

    def hit_seconds() -> float:
        question = tokenizer.encode(f" Question {next(questions)}: what does this section say?")
        started = time.perf_counter()
        llm.generate([document + question], one_token)
        return time.perf_counter() - started

    hit_seconds()  # the document is computed once, then cached on the device
    default_interval = sys.getswitchinterval()
    rows = []
    with tempfile.TemporaryDirectory() as store_dir:
        for interval_ms in (float(x) for x in args.intervals_ms.split(",")):
            sys.setswitchinterval(interval_ms / 1000)
            alone = statistics.median(hit_seconds() for _ in range(args.hits))
            row = {"interval_ms": interval_ms, "alone_s": alone, "beside": {}}
            for kind in args.kinds.split(","):
                stop = threading.Event()
                thread = threading.Thread(target=background_work(kind, llm, store_dir, stop), daemon=True)
                thread.start()
                time.sleep(0.3)
                row["beside"][kind] = statistics.median(hit_seconds() for _ in range(args.hits))
                stop.set()
                thread.join()
            rows.append(row)
            print(f"switch interval {interval_ms} ms: alone {alone * 1000:.0f} ms, "
                  + ", ".join(f"{k} {v * 1000:.0f} ms ({v / alone:.2f}x)" for k, v in row["beside"].items()),
                  flush=True)
    sys.setswitchinterval(default_interval)
    llm.close()

    result = results_record("background_threads", hits_per_cell=args.hits, doc_tokens=args.doc_tokens, rows=rows)
    kinds = args.kinds.split(",")
    lines = ["# A cache hit beside other threads' work", "", *provenance_lines(result), "",
             f"TTFT of a 16-token question over a {args.doc_tokens}-token document cached on the device (median "
             f"of {args.hits}), float32, one torch thread, alone and with another thread of the process looping "
             "over the named work; the interpreter's switch interval is the longest the step thread waits "
             "for the lock each time it takes it back.", "",
             "| switch interval | alone | " + " | ".join(f"beside {k}" for k in kinds) + " |",
             "|---:|---:|" + "---:|" * len(kinds)]
    for row in rows:
        cells = " | ".join(f"{row['beside'][k] * 1000:.0f} ms ({row['beside'][k] / row['alone_s']:.2f}x)"
                           for k in kinds)
        lines.append(f"| {row['interval_ms']:g} ms | {row['alone_s'] * 1000:.0f} ms | {cells} |")
    write_results(args.out_dir, result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
