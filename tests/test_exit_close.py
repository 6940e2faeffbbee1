"""A process that exits without closing what it opened still stops the engine's thread and writes its cached blocks
down, in order: the async engine's thread first, then the engine's tiers, never one under another's step."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstrata.tiers.lmdb_store import read_store_stats

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parent.parent


def test_an_async_engine_left_running_at_exit_is_shut_down_and_its_blocks_written_down(tmp_path):
    disk = tmp_path / "kv"
    script = textwrap.dedent(f"""
        import asyncio, atexit, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from benchmarks.suites.host.engine import build_engine
        from kvstrata.engine.async_engine import AsyncEngine
        from kvstrata.engine.sampling import SamplingParams

        engine = build_engine(Path({str(tmp_path)!r}),
                              cache={{"tiers": {{"cpu": {{"size": 64}}, "disk": {{"path": {str(disk)!r}, "size": "64MiB"}}}}}})
        async_engine = None
        # registered before the async engine's own exit handler, so it runs after it: what did that leave?
        atexit.register(lambda: print("thread alive:", async_engine._thread.is_alive(),
                                      "closed:", async_engine.final_stats is not None, flush=True))
        async_engine = AsyncEngine(engine)

        async def ask():
            async for _ in async_engine.generate(list(range(100, 100 + 20 * 16 + 1)), SamplingParams(max_tokens=2)):
                pass

        asyncio.run(ask())
        # no shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "thread alive: False closed: True" in out.stdout
    assert read_store_stats(str(disk))["entries"] >= 20  # the prompt's 20 full blocks, on disk
