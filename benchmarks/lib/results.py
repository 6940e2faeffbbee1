"""The one way a benchmark writes its result: `<name>.json` (its figures, with the benchmark's name and the command,
machine and commit that produced them) and `<name>.md` (its report, whose first lines after the title say the same,
`machine.provenance_lines`). No other module writes a result file (tests/test_benchmarks_layout.py checks)."""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from benchmarks.lib.machine import REPO_ROOT, command_line, machine_line, provenance_lines, source_state

PROVENANCE_KEYS = ("benchmark", "command", "machine", "source")
HEAD_LINES = 8  # where a report's provenance lines are looked for


def record(benchmark: str, **figures) -> dict:
    """A result: the benchmark's name, then the command, machine and code that produced it (what
    `provenance_lines` reads), then its figures."""
    return {"benchmark": benchmark, "command": command_line(), "machine": machine_line(), "source": source_state(),
            **figures}


def with_provenance(report: str, result: dict) -> str:
    """`report` with the provenance lines after its title, unless its first lines give its command already (as
    `provenance_lines` does): every report says what produced it where a reader looks first."""
    if any(line.startswith("Command: `") for line in report.splitlines()[:HEAD_LINES]):
        return report
    title, _, rest = report.partition("\n")
    if not title.startswith("#"):
        title, rest = "", report
    lines = ([title, ""] if title else []) + provenance_lines(result) + ["", rest.lstrip("\n")]
    return "\n".join(lines)


def local_paths(extra: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """This machine's paths and what a result says instead: the checkout's relative paths, `site-packages`, and
    `extra`'s (a benchmark's working folder, say)."""
    return [*(extra or {}).items(), (sysconfig.get_paths()["purelib"], "site-packages"),
            (str(REPO_ROOT) + os.sep, ""), (str(REPO_ROOT), ".")]


def scrub(text: str, paths: dict[str, str] | None = None) -> str:
    """`text` naming files relative to the checkout or the environment, never by this machine's paths."""
    for old, new in local_paths(paths):
        text = text.replace(old, new)
    return text


def write(out_dir: str | os.PathLike, result: dict, report: str | list[str], name: str | None = None,
          paths: dict[str, str] | None = None) -> Path:
    """`result` as `<name>.json` and `report` (text, or its lines) as `<name>.md` in `out_dir` (made if missing),
    `name` by default the result's benchmark; the report's path. A result made without `record` gets its
    provenance keys here."""
    missing = [key for key in PROVENANCE_KEYS if key not in result]
    if missing:
        made = record(result.get("benchmark") or name)
        result = {**{key: made[key] for key in missing}, **result}
    name = name or result["benchmark"]
    text = report if isinstance(report, str) else "\n".join(report) + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(scrub(json.dumps(result, indent=1, default=str), paths) + "\n")
    markdown = out / f"{name}.md"
    markdown.write_text(scrub(with_provenance(text, result), paths))
    print(f"wrote {markdown} and {name}.json")
    return markdown


def publish(result: dict, report: str | list[str], out_dir: str | os.PathLike | None, name: str | None = None,
            paths: dict[str, str] | None = None) -> Path | None:
    """Print the report; with `out_dir`, also write it and `result` there (`write`)."""
    print(report if isinstance(report, str) else "\n".join(report))
    return write(out_dir, result, report, name, paths) if out_dir else None
