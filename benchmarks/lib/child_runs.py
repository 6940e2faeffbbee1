"""Running a benchmark's child process: until a deadline, its lines handed on as they come (a run stopped midway
still shows how far it got), and a pytest run's JUnit XML counted."""
from __future__ import annotations

import subprocess
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ChildRun:
    returncode: int
    lines: list[str]  # what it printed on stdout, line by line
    stopped: bool     # killed at its deadline


def run_until(command: list[str], env: dict, deadline: float, on_line=None, stderr=subprocess.STDOUT,
              cwd: Path | None = None) -> ChildRun:
    """Run `command` until it ends or `deadline` (a time.time()) passes, when it is killed; each line it prints is
    handed to `on_line` as it comes, so that a run stopped midway still shows how far it got. `stderr`: where its
    stderr goes (by default into its stdout)."""
    lines: list[str] = []
    killed = threading.Event()

    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True) as child:
        def kill() -> None:
            killed.set()
            child.kill()

        killer = threading.Timer(max(0.0, deadline - time.time()), kill)
        killer.start()
        try:
            for line in child.stdout:
                lines.append(line.rstrip("\n"))
                if on_line is not None:
                    on_line(lines[-1])
            returncode = child.wait()
        finally:
            killer.cancel()
    return ChildRun(returncode, lines, killed.is_set() and returncode != 0)


def junit_counts(path: Path) -> dict:
    """Passed, failed, errors and skipped test cases of a JUnit XML file, and the names of those that did not pass."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_passed": [], "why": {}}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(getattr(outcome, "tag", None), "passed")
        counts[key] += 1
        if key in ("failed", "errors"):
            name = f"{case.get('classname')}::{case.get('name')}"
            counts["not_passed"].append(name)
            # the report is read where the test's output is gone (a machine lent for minutes): say why it failed
            counts["why"][name] = ((outcome.get("message") or "").strip().splitlines() or [""])[0][:300]
    return counts
