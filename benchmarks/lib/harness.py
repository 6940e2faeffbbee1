"""Shared by every suite: run a suite's subcommand (each lives in benchmarks/suites/SUITE/), run one of those
modules in a process of its own, and drive an engine for a benchmark: load the config's model, render a chat
message, ask one prompt and keep its record, resize the tiers and sample the machine's load while a run goes on
(a result is written by results.py). Nothing here is an entry point."""
from __future__ import annotations

import importlib
import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib.ttft_stats import TIERS, hit_tier

_request_ids = itertools.count()
REPO_ROOT = Path(__file__).resolve().parents[2]
SUITES_PACKAGE = "benchmarks.suites"


@dataclass(frozen=True)
class Subcommand:
    """One measurement of a suite: its name on the command line, the module whose `main(argv)` runs it (`SUITE.NAME`
    for benchmarks/suites/SUITE/NAME.py), and one line of help."""

    name: str
    module: str
    help: str


def run_suite(doc: str, subcommands: tuple[Subcommand, ...], argv: list[str] | None = None) -> int:
    """`SUITE.py SUBCOMMAND [options]`: the subcommand's module is imported only when it runs, so that `--help`
    and a bad name answer at once, without torch or a model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    by_name = {s.name: s for s in subcommands}
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(name) for name in by_name)
        print(doc.strip() + "\n\nsubcommands (`SUBCOMMAND --help` for its options):")
        print("\n".join(f"  {s.name:<{width}}  {s.help}" for s in subcommands))
        return 0 if argv else 2
    chosen = by_name.get(argv[0])
    if chosen is None:
        print(f"error: unknown subcommand {argv[0]!r}; choose one of {', '.join(by_name)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"{SUITES_PACKAGE}.{chosen.module}").main(argv[1:]) or 0


def module_command(module_file: str, *args: str) -> list[str]:
    """A command line that runs `main(args)` of the subcommand module at `module_file` in a new process (a module
    there is no script of its own): for measurements that need a fresh process or another commit's code."""
    module = ".".join(Path(module_file).resolve().relative_to(REPO_ROOT).with_suffix("").parts)
    # the checkout goes last, so that a baseline's `kvstrata` first on PYTHONPATH is the one imported
    code = (f"import sys; sys.path = [p for p in sys.path if p] + [{str(REPO_ROOT)!r}]; "
            f"from {module} import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, *args]


class LoadSampler:
    """Samples the 1-minute load average every few seconds while the benchmark runs (a shared
    machine makes timings noisy; the report says how busy it was)."""

    def __init__(self, interval_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(interval_s)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(s)}


def load(config):
    """The config's model in its resolved dtype, and the seconds loading took."""
    from kvstrata.engine.model_loader import load_model, resolve_model

    import torch

    dtype = config.resolved_dtype()
    print(f"loading {config.model.name} ({dtype}) ...", flush=True)
    started = time.perf_counter()
    loaded = load_model(resolve_model(config.model.name, config.model.load_format), getattr(torch, dtype),
                        config.resolved_device())
    return loaded, time.perf_counter() - started


def render_chat(tokenizer, content: str) -> list[int]:
    """One user message, rendered as the engine renders chats."""
    from kvstrata.engine import prompts

    return prompts.render_chat(tokenizer, [{"role": "user", "content": content}])


def ask(engine, token_ids, cache_salt: str | None = None) -> dict:
    """Send one prompt through the engine alone (as `LLM.generate` does) and return its record."""
    from kvstrata.engine.llm import RequestOutput
    from kvstrata.engine.sampling import SamplingParams

    request_id = f"ttft-{next(_request_ids)}"
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request(request_id, list(token_ids), params, cache_salt=cache_salt, arrival_time=time.perf_counter())
    while engine.has_unfinished_requests():
        engine.step()
    out = RequestOutput.from_request(engine.requests[request_id])
    engine.release(request_id)
    by_tier = {t: int(out.cached_tokens_by_tier.get(t, 0)) for t in TIERS}
    return {"ttft_s": out.ttft_s, "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": sum(by_tier.values()),
            "computed_tokens": len(out.prompt_token_ids) - sum(by_tier.values()),
            "cached_tokens_by_tier": by_tier, "hit_tier": hit_tier(by_tier, len(out.prompt_token_ids)),
            "recomputed_tokens_by_tier": {t: int(out.recomputed_tokens_by_tier.get(t, 0)) for t in TIERS},
            "receipt": out.receipt.to_dict(), "text": out.text}


def set_tiers(base, overrides: dict):
    """`base` with its tiers resized by `overrides` (dotted keys; None turns a tier off)."""
    from kvstrata import load_config

    # a section set to None first, then sized, becomes a fresh section with its defaults plus the size
    nulls = {k: v for k, v in overrides.items() if v is None}
    config = load_config(base, nulls)
    return load_config(config, {k: v for k, v in overrides.items() if v is not None})
