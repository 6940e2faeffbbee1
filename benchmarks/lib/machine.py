"""What every benchmark report says about what produced it: the machine (one line, the same in each report,
so that figures from different benchmarks can be set side by side), the command and the commit measured."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(**versions: str) -> str:
    """CPU, cores, memory, accelerator, OS, Python and torch (with its thread count), then `versions`
    (the packages a benchmark's figures also depend on, e.g. xxhash for hashing)."""
    import torch

    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    line = (f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} CPU cores, {memory_gib:.0f} GiB RAM, "
            f"{accelerator}; {platform.system()} {platform.release()}; Python {platform.python_version()}; "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    return "; ".join([line, *(f"{name} {version}" for name, version in versions.items())])


def provenance_lines(result: dict) -> list[str]:
    """A results file's first lines: the command, the machine and the code (`result`'s "command",
    "machine" and "source", as `source_state` gives it) that produced its figures."""
    source = result["source"]
    modified = source["engine_sources_modified"]
    return [f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
            f"Code: commit {source['commit']}" + (f", with uncommitted changes to {', '.join(modified)}"
                                                  if modified else "")]


def source_state() -> dict:
    """The commit measured, and whether the engine's sources differed from it (a run on a dirty tree
    measures code no commit holds)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip()  # porcelain lines start with a space
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = git("status", "--porcelain", "--", "engine", "tiers", "kernels", "kvstrata")
    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "engine_sources_modified": [line[3:] for line in changed.splitlines()]}


def repo_relative(path: str) -> str:
    """`path` relative to the checkout, as results name files (never by one machine's paths)."""
    try:
        return os.path.relpath(path, REPO_ROOT)
    except ValueError:
        return path


def command_line() -> str:
    """The command that is running, as a results file quotes it: `python benchmarks/...` and its options."""
    argv = [repo_relative(sys.argv[0])] + [repo_relative(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
    return "python " + " ".join(shlex.quote(a) for a in argv)


def best_seconds(fn, repeats: int, sync) -> float:
    """Fastest of `repeats` timed calls (after one warm-up call): the machine's capability, not its noise."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def reference_bandwidth(device, repeats: int, sync, direction: str = "h2d",
                        nbytes: int = 1 << 30) -> tuple[float, str]:
    """Bytes per second of the copy a promotion is measured against: with CUDA a pinned host buffer
    copied to the device (`direction` "h2d") or back ("d2h"); on a CPU-only machine host memcpy."""
    import numpy as np
    import torch

    size = f"{nbytes / (1 << 30):g} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src, dst = (host, on_device) if direction == "h2d" else (on_device, host)
        what = f"pinned {'host-to-device' if direction == 'h2d' else 'device-to-host'} copy of {size}"
        seconds = best_seconds(lambda: dst.copy_(src, non_blocking=True), repeats, sync)
        return nbytes / seconds, what
    # On the host, the faster of torch's (multi-threaded) copy and numpy's single memcpy: on a busy
    # machine torch's thread handoff can make it the slower one, which would flatter every ratio.
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    torch_s = best_seconds(lambda: dst.copy_(src), repeats, sync)
    numpy_s = best_seconds(lambda: np.copyto(dst.numpy(), src.numpy()), repeats, sync)
    return nbytes / min(torch_s, numpy_s), f"host memcpy of {size} (the faster of torch copy_ and numpy copyto)"
