"""What every benchmark report says about the machine it ran on: one line, the same in each report,
so that figures from different benchmarks can be set side by side."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path


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
    "machine" and "source", as `ttft_pressure.source_state` gives it) that produced its figures."""
    source = result["source"]
    modified = source["engine_sources_modified"]
    return [f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
            f"Code: commit {source['commit']}" + (f", with uncommitted changes to {', '.join(modified)}"
                                                  if modified else "")]


def results_record(benchmark: str, **figures) -> dict:
    """A results file's JSON: the benchmark's name, then the command, machine and code that produced it (what
    `provenance_lines` reads), then its figures."""
    from benchmarks.ttft_pressure import command_line, source_state  # (it imports this module)

    return {"benchmark": benchmark, "command": command_line(), "machine": machine_line(), "source": source_state(),
            **figures}


def write_results(out_dir: str | os.PathLike, result: dict, lines: list[str]) -> Path:
    """`result` as `<benchmark>.json` and the report `lines` as `<benchmark>.md` in `out_dir`; the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['benchmark']}.json").write_text(json.dumps(result, indent=1) + "\n")
    report = out / f"{result['benchmark']}.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"wrote {report}")
    return report


def publish(result: dict, lines: list[str], out_dir: str | os.PathLike | None) -> None:
    """Print the report `lines`; with `out_dir`, also write them and `result` there (`write_results`)."""
    print("\n".join(lines))
    if out_dir:
        write_results(out_dir, result, lines)
