"""On a CUDA GPU: the GPU report with its goals, the diagnostics behind its figures, and steps as CUDA graphs.

    make gpu-report           # = python benchmarks/gpu.py report: writes benchmarks/results/gpu.md and gpu.json
    python benchmarks/gpu.py report --smoke --out /tmp/gpu-smoke.md    # every section on the CPU, tiny shapes
    python benchmarks/gpu.py diag --parts a,b,c,d,e --models smollm2 --out-dir DIR

`report` runs the CUDA tests, pinned H2D/D2H bandwidth, promotion as a share of it, the kernel tables, the decoder
steps, single-request TTFT per tier and the decode gap beside a hit, and says which GPU goals are met; `diag`
(parts a-e) times what lies behind those figures: disk promotion by reader count and staging, a disk hit after a
restart, the steps around a CPU-tier hit, the load policies and layer-by-layer loading (results/gpu_diag_h200.md); `graph-steps` times the decoder's steps eager,
through transformers and as CUDA graphs without the embedded model's wheel.
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("report", "gpu.report", "the GPU figures and goals in one run (refuses without CUDA; --smoke on "
               "a CPU)"),
    Subcommand("diag", "gpu.diag", "behind the report's figures: disk readers, restarts, the steps around a hit, "
               "layer-by-layer loads"),
    Subcommand("graph-steps", "gpu.graph_steps", "decoder steps eager, through transformers and as CUDA graphs"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
