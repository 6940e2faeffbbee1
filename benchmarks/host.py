"""What the host spends around the model: the engine's step, a request before its first token, serving, a hit
beside decodes, the model's load at start and the structured-output mask, with the model replaced by fixed logits
where the model is not the point. `--baseline REV` (engine, request, serving, hit-beside-decodes) times another
commit's engine in turn, each side in a process of its own.

    python benchmarks/host.py engine --baseline REV --out-dir benchmarks/results
    python benchmarks/host.py request --out-dir benchmarks/results

Retired (git keeps them; their reports are in results/archive/): `gc_pause.py` (a full collection walked the
model and tiers; the engine now freezes its start-up objects, 2.7 ms after bursts of 64), `burst_lookup.py` (a
burst's lookups now go together, one remote round trip per step), `output_snapshot.py` (a snapshot over a
7000-token prompt with prompt_logprobs went from 26 ms a step to 0.5 ms) and `answer_json.py` (a whole answer is
written by pydantic's compiled serializer off the event loop, kvstrata/serving/responses.py).
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root leads the path instead of benchmarks/, whose kernels.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # would stand for the installed `kernels`

from benchmarks.lib.harness import Subcommand, run_suite  # noqa: E402

SUBCOMMANDS = (
    Subcommand("engine", "host.engine", "the engine's host work per decode step, outside the model"),
    Subcommand("request", "host.request", "a request's host cost before its first token, by phase"),
    Subcommand("serving", "host.serving", "what AsyncEngine and the HTTP server add to a decode step"),
    Subcommand("hit-beside-decodes", "host.hit_beside_decodes",
               "a lower-tier hit's TTFT beside four decoding sequences, and their longest step"),
    Subcommand("startup", "host.startup", "the embedded model's load at start: from its GGUF, first and later starts"),
    Subcommand("router-start", "host.router_start", "`kvstrata route`'s start: time, peak memory, torch or not"),
    Subcommand("cpu-step", "host.cpu_step",
               "a device hit's TTFT and decode ms/token on the CPU, beside another checkout and transformers"),
    Subcommand("structured-outputs", "host.structured_outputs",
               "the grammar mask of B structured rows against B plain decode steps"),
)


def main(argv: list[str] | None = None) -> int:
    return run_suite(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
