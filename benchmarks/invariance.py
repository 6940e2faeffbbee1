"""Whether caching changes what the model answers, and what keeping answers the same costs.

    python benchmarks/invariance.py cache [--dtype float32,bfloat16] [--doc-tokens 1000]
    python benchmarks/invariance.py kv-dtype [--kv-dtypes auto,bfloat16,int8,fp8,fp8_e5m2]
    python benchmarks/invariance.py batch ops|trace|tiles|cost

`cache` compares greedy answers over a cached document with prefix caching off, per dtype; `kv-dtype` what each
`cache.kv_cache_dtype` trades in a block's bytes against the answers; `batch` where caching changes bfloat16 bits
and what `model.batch_invariant` costs. These measure outputs, not time (but `batch cost`).
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("cache", "invariance.cache", "greedy answers over a cached document against prefix caching off, "
               "per dtype"),
    Subcommand("kv-dtype", "invariance.kv_dtype", "a block's bytes against the answers, per cache.kv_cache_dtype"),
    Subcommand("batch", "invariance.batch", "which ops change bits with the batch's shape, and the invariant "
               "mode's cost (ops, trace, tiles, cost)"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
