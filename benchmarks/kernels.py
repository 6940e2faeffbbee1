"""Kernels and the model step: what paging costs attention, and what a step costs the host.

    python benchmarks/kernels.py paging --repeats 7
    python benchmarks/kernels.py decoder-step --out-dir benchmarks/results
    python benchmarks/kernels.py layer-ops --out-dir benchmarks/results
    python benchmarks/kernels.py cpu-linear --out benchmarks/results/cpu_linear.md

`paging` times paged prefix-prefill against contiguous SDPA (Triton on CUDA, the torch reference on a CPU) and,
on CUDA, split-KV against one pass; `decoder-step` times kvstrata's decoder against transformers' modules on the
same weights, paged cache and inputs (SmolLM2 and a thin 30-layer model, fp32 and bf16); `layer-ops` times a
layer's per-row ops on a CPU (RMSNorm, rotary, SiLU-and-mul, the K/V store) per call, torch reference against
compiled. On a GPU the same steps as CUDA graphs are `benchmarks/gpu.py graph-steps`.
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("paging", "kernels.paging", "paged prefix-prefill against contiguous SDPA; split-KV on CUDA"),
    Subcommand("cpu-linear", "kernels.cpu_linear", "the compiled CPU linear layer against F.linear, per product "
               "and row count"),
    Subcommand("decoder-step", "kernels.decoder_step", "a model step's cost: kvstrata's decoder against transformers' "
               "modules"),
    Subcommand("layer-ops", "kernels.layer_ops", "a layer's per-row ops on a CPU, per call: torch references against "
               "the compiled kernels"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
