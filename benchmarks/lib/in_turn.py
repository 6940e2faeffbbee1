"""Timing this commit's code against another's, in turn: each side runs a benchmark's worker in a process of its
own, the other commit's `kvstrata` first on that process's path (checked out in a temporary git worktree), the
sides alternating so that the machine's drift falls on both. A benchmark takes the options of
`options.in_turn` and runs its worker with `--worker ARG`."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Callable, Iterator

from benchmarks.lib.harness import REPO_ROOT, module_command


def baseline_import_root(rev: str, work_dir: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes `kvstrata` import the engine of commit `rev`: the commit in a
    worktree, its packages laid out as its pyproject maps them (`import_root_of`)."""
    tree = work_dir / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=REPO_ROOT, check=True)
    return import_root_of(tree, work_dir / "root")


def import_root_of(tree: Path, root: Path) -> Path:
    """`root`, made to hold the `kvstrata` packages of the checkout `tree` alone, laid out as its pyproject maps
    them: first on PYTHONPATH, it makes `kvstrata` import that checkout's code while everything else (this tree's
    `benchmarks` among it) is still imported from here."""
    package_dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = root / "kvstrata"
    top.mkdir(parents=True)
    for entry in (tree / package_dirs["kvstrata"]).iterdir():
        (top / entry.name).symlink_to(entry)
    for package, directory in package_dirs.items():
        link = root / package.replace(".", "/")
        if package != "kvstrata" and not link.exists():  # a checkout whose kvstrata/ links its packages has them
            link.symlink_to(tree / directory)
    return root


def run_worker(script: str, worker_arg: str, import_root: Path | None) -> dict:
    """`script --worker worker_arg` in a process of its own, with `import_root` (a baseline's) first on its
    PYTHONPATH; the JSON of its last printed line."""
    env = dict(os.environ)
    if import_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(import_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(module_command(script, "--worker", worker_arg), env=env, stdout=subprocess.PIPE,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def runs_in_turn(script: str, worker_arg: str, args, describe: Callable[[dict], str]) -> dict[str, list[dict]]:
    """Every side's runs (each_side_in_turn with the standard options `args`), each printed as it comes:
    `run N, side (code): describe(what it measured)`."""
    runs: dict[str, list[dict]] = {}
    for repeat, side, measured in each_side_in_turn(script, worker_arg, args.baseline, args.repeats):
        # where the code was imported from: printed (a check that the sides differ), not kept in the results
        code = measured.pop("engine_code", None) or measured.pop("tiers_code", None)
        runs.setdefault(side, []).append(measured)
        print(f"run {repeat + 1}, {side} ({code}): {describe(measured)}", flush=True)
    return runs


def each_side_in_turn(script: str, worker_arg: str, baseline: str | None,
                      repeats: int) -> Iterator[tuple[int, str, dict]]:
    """(repeat, side, what the worker measured) for `repeats` runs of this commit's code ("this") and, with
    `baseline`, of that commit's ("baseline", from a temporary git worktree), in turn."""
    with tempfile.TemporaryDirectory() as work_dir:
        sides = {"this": None}
        if baseline:
            sides["baseline"] = baseline_import_root(baseline, Path(work_dir))
        try:
            for repeat in range(repeats):
                for side, import_root in sides.items():
                    yield repeat, side, run_worker(script, worker_arg, import_root)
        finally:
            if baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(work_dir) / "tree")],
                               cwd=REPO_ROOT, check=False)
