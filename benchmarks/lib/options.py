"""The options the benchmarks share, each defined once. A subcommand builds its parser with `parser` and adds the
common options it takes with these functions, so that `--out-dir`, `--repeats`, `--set` ... have one name, type
and destination in every suite; a benchmark chooses only a default and a help line. No other module adds an
option named in `COMMON` (tests/test_benchmarks_layout.py checks)."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.arguments import non_negative_int, positive_int  # noqa: F401 (the suites' counts take these types)

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = str(REPO_ROOT / "benchmarks" / "results")
DEFAULT_CONFIG = str(REPO_ROOT / "configs" / "default.yaml")

COMMON = ("--out-dir", "--out", "--config", "--set", "--threads", "--dtype", "--repeats", "--quick", "--seed",
          "--baseline", "--data", "--name", "--device")


def parser(doc: str, prog: str | None = None, whole_doc: bool = False) -> argparse.ArgumentParser:
    """A subcommand's parser, described by the first paragraph of `doc` (its module's docstring), or by all of it
    as written (`whole_doc`)."""
    if whole_doc:
        return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n\n")[0])


def out_dir(p: argparse.ArgumentParser, default: str | None = None, help: str | None = None) -> None:
    """`--out-dir DIR`: the folder the result's .md and .json go to (none: printed only, where the default is
    None)."""
    p.add_argument("--out-dir", default=default, help=help)


def out(p: argparse.ArgumentParser, default: str | None = None, help: str | None = None) -> None:
    """`--out PATH`: the result's folder, or its report's file (the JSON beside it), as the benchmark's help says."""
    p.add_argument("--out", default=default, help=help)


def config(p: argparse.ArgumentParser, default: str = DEFAULT_CONFIG, help: str | None = None) -> None:
    """`--config FILE`: the kvstrata YAML config the benchmark's engine is built from."""
    p.add_argument("--config", default=default, help=help)


def overrides(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--set KEY=VALUE` (repeatable, into `args.overrides`): config keys overridden, as `kvstrata serve --set`."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def threads(p: argparse.ArgumentParser, default: int | list[int] | None = None, help: str | None = None,
            many: bool = False) -> None:
    """`--threads N` (`many`: one or more N, a run each): torch's CPU threads."""
    p.add_argument("--threads", type=positive_int, default=default, help=help, **({"nargs": "+"} if many else {}))


def dtype(p: argparse.ArgumentParser, default: str | list[str] | None = None, help: str | None = None,
          many: bool = False) -> None:
    """`--dtype D` (`many`: one or more D, a run each; a benchmark may take D as a comma-separated list): the
    model's dtype."""
    p.add_argument("--dtype", default=default, help=help, **({"nargs": "+"} if many else {}))


def repeats(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    """`--repeats N`: timed runs of each figure (the benchmark's help says which of them counts)."""
    p.add_argument("--repeats", type=positive_int, default=default, help=help)


def seed(p: argparse.ArgumentParser, default: int = 0, help: str | None = None) -> None:
    """`--seed N`: the seed of the benchmark's random choices, so that a run can be repeated."""
    p.add_argument("--seed", type=int, default=default, help=help)


def quick(p: argparse.ArgumentParser, help: str) -> None:
    """`--quick`: a small run that checks the benchmark works, its figures not worth keeping."""
    p.add_argument("--quick", action="store_true", help=help)


def baseline(p: argparse.ArgumentParser, help: str = "also time the code of this commit, in turn") -> None:
    """`--baseline REV`: another commit's code, timed beside this one's."""
    p.add_argument("--baseline", metavar="REV", help=help)


def in_turn(p: argparse.ArgumentParser, name: str) -> None:
    """The options of a benchmark that times this commit's code against `--baseline` in turn (lib/in_turn.py),
    writing `name`.md and .json; the benchmark adds its own."""
    baseline(p)
    repeats(p, 3, help="runs of each side; the best counts")
    out_dir(p, help=f"write {name}.md and .json here")
    p.add_argument("--worker", help=argparse.SUPPRESS)


def data(p: argparse.ArgumentParser, default: str | None, help: str | None = None) -> None:
    """`--data FILE`: the long-document QA questions (jsonl) the workload is drawn from."""
    p.add_argument("--data", default=default, help=help)


def name(p: argparse.ArgumentParser, default: str, help: str | None = "stem of the output files") -> None:
    """`--name STEM`: the result's file names, `STEM.md` and `STEM.json`."""
    p.add_argument("--name", default=default, help=help)


def device(p: argparse.ArgumentParser, default: str, help: str | None = None) -> None:
    """`--device D`: where the model or kernel runs (cpu, cuda)."""
    p.add_argument("--device", default=default, help=help)
