"""Time to first token: long-document QA under memory pressure, and under concurrency.

    python benchmarks/ttft.py pressure --config configs/pressure.yaml --threads 1      # or `make bench`
    python benchmarks/ttft.py concurrency --config configs/pressure.yaml --streams 4
    python benchmarks/ttft.py cpu-report      # or `make cpu-report`: beside vLLM, every CPU goal, this CPU family

`pressure` measures recompute, each tier set-up, a restart on the disk tier, the replicas sharing a remote tier
(`--configs ...,replicas`), dtypes side by side (`--dtype`) and the peers (transformers, llama.cpp; vLLM's rows
with `--peers ...,vllm`) on the same prompts; `concurrency` runs `scheduler.policy` fcfs against uncached_first
under N streams or Poisson arrivals, or with `--guidellm kvstrata,vllm` our server and vLLM's under guidellm
(benchmarks/results/guidellm.md has our server's earlier runs); `vllm` runs vLLM beside us on the same CPU (a
miss, a device hit, decode per token, per dtype; vLLM in a venv of its own, made once in the user's cache);
`cpu-report` runs those beside vLLM, the compiled kernels' tests and the batch-invariant mode's cost, and says which
goals of the CPU-speed issue this CPU family meets. The workload, statistics, report and peers are modules of
benchmarks/lib/ (ttft_workload, ttft_stats, ttft_report, peers).

Retired (git keeps them): `threads.py` timed TTFT per torch thread count, the measurement behind
`model.threads: auto` (results/archive/threads.md); `background_threads.py` found native work beside the step
thread costs a hit 1.07-1.34x while a pure-Python thread costs it 59x at the default switch interval, which is why
the server keeps the step thread's neighbours native (results/archive/background_threads.md).
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("pressure", "ttft.pressure", "TTFT with the working set 4x the device tier, per tier set-up, "
               "restart, replicas, dtypes and peers"),
    Subcommand("concurrency", "ttft.concurrency", "fcfs against uncached_first: hit and miss TTFT, token gaps, "
               "throughput under streams or Poisson arrivals"),
    Subcommand("vllm", "ttft.vllm", "against vLLM on the same CPU: miss and device-hit TTFT, decode ms/token, "
               "per dtype"),
    Subcommand("cpu-report", "ttft.cpu_report", "beside vLLM on this CPU, in one run: every goal of the CPU-speed "
               "issue met or not for this CPU family"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
