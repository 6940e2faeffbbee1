"""`kvstrata serve`: bind, load the model, serve the app, drain on SIGTERM, write the cache down.

Shutting down, in order: the first SIGTERM (or Ctrl-C) starts a drain: new API requests get a 503
and `/health` turns 503 (so a load balancer stops sending), while the requests in flight finish
(streams to their last event), for at most `server.drain_timeout`. Then the listening socket closes,
the engine stops and writes the cache down to the disk tier, and the last line printed says
whether that worked. A second signal ends the drain at once.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from kvstrata import __version__
from kvstrata.engine.config import Config
from kvstrata.tiers.names import TIER_NAMES
from kvstrata.tiers.storage import format_bytes
from kvstrata.serving.app import build_app
from kvstrata.serving.metrics import ServingMetrics
from kvstrata.serving.middleware import DrainState
from kvstrata.serving.sockets import bind_socket, listen
from kvstrata.serving.stats_log import StatsLogger
from kvstrata.serving.tokenizer_pool import TokenizerPool

if TYPE_CHECKING:
    from kvstrata.engine.async_engine import AsyncEngine

# How long a drain waits for the requests in flight before they are cancelled (and so aborted):
# `server.drain_timeout`.
# After the drain, how long uvicorn waits for what is left before cancelling it.
CANCEL_AFTER_DRAIN_S = 5


class _Server(uvicorn.Server):
    """uvicorn with a drain: a signal first stops new requests (503) and lets those in flight finish
    while the socket stays open; uvicorn's own shutdown starts when none is left. Unlike uvicorn, it
    does not re-raise the signal afterwards, so the process lives on to write its cache down: `serve`
    closes the engine and returns."""

    def __init__(self, config: uvicorn.Config, drain: DrainState, drain_timeout: float):
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self.received_signal: int | None = None
        self._drain_deadline = 0.0

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.received_signal is None:
            self.received_signal = sig
            self.drain.draining = True
            self._drain_deadline = time.monotonic() + self.drain_timeout
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and (self.drain.in_flight == 0 or time.monotonic() > self._drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)


def serve(config: Config) -> None:
    """Bind, load the model, print where we listen, serve until SIGTERM/SIGINT, drain, then write
    the cache down to disk. Ctrl-C raises KeyboardInterrupt at the end (the CLI exits 130); SIGTERM
    returns normally (exit 0)."""
    sock = bind_socket(config.server.host, config.server.port)
    async_engine = tokenizers = server = publisher = trace = stats_log = None
    try:
        from kvstrata.engine.async_engine import AsyncEngine
        from kvstrata.engine.llm_engine import LLMEngine

        if config.events is not None:  # bound before the model loads: an endpoint in use is reported at once
            from kvstrata.serving.events import KVEventPublisher
            publisher = KVEventPublisher(config.events)
        llm_engine = LLMEngine(config, block_events=publisher)
        tokenizers = TokenizerPool(llm_engine.tokenizer)  # copied before the engine thread uses the original
        async_engine = AsyncEngine(llm_engine, watchdog_timeout=config.scheduler.watchdog_timeout)
        model_id = config.server.model_alias or config.model.name
        metrics = ServingMetrics(lambda: async_engine.snapshot, events=publisher,
                                 model_name=model_id if config.server.vllm_metrics else None,
                                 max_model_len=llm_engine.max_model_len)
        async_engine.listener = metrics  # set before any request: the engine thread reads it for requests only
        if config.server.trace_log is not None:  # each request appended to a trace for `kvstrata plan`
            from kvstrata.trace import TraceLog, TraceWriter
            trace = TraceWriter(config.server.trace_log, config.cache.block_size)
            async_engine.listener = TraceLog(metrics, trace)
        drain = DrainState()
        app = build_app(async_engine, model_id, metrics=metrics, tokenizers=tokenizers, drain=drain,
                        api_key=config.server.api_key, max_request_body=config.server.max_request_body,
                        access_log=config.server.access_log)
        listen(sock)  # before the banner that says so
        print(_banner(config, async_engine, model_id, sock), flush=True)
        if config.server.stats_interval > 0:
            stats_log = StatsLogger(metrics.registry, llm_engine.layout.block_nbytes,
                                    config.server.stats_interval).start()
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=CANCEL_AFTER_DRAIN_S), drain,
                         config.server.drain_timeout)
        server.run(sockets=[sock])
    finally:
        if stats_log is not None:
            stats_log.stop()
        sock.close()
        if tokenizers is not None:
            tokenizers.close()
        if async_engine is not None:
            async_engine.shutdown()
        if publisher is not None:  # after the engine's close, whose write-down to disk it reports
            publisher.close()
        if trace is not None:
            trace.close()
    print(stopped_message(config, async_engine.final_stats), flush=True)
    if server.received_signal == signal.SIGINT:
        raise KeyboardInterrupt


def stopped_message(config: Config, final_stats: dict | None) -> str:
    """The last line `serve` prints: whether the cache reached the disk tier, from what the engine
    measured at its close (`final_stats`: None when closing failed)."""
    disk = config.cache.tiers.disk
    if disk is None:
        return "kvstrata: stopped"
    if final_stats is None:
        return f"kvstrata: stopped; writing the cache down to {disk.path} failed (see the error above)"
    disk_stats = final_stats["tiers"].get("disk")
    if disk_stats is None:  # prefix caching off: no tier below the device
        return "kvstrata: stopped"
    write_errors = disk_stats["extra"].get("write_errors", 0)
    if write_errors:
        return (f"kvstrata: stopped; {write_errors} write{'s' if write_errors > 1 else ''} to the disk tier at "
                f"{disk.path} failed (see the errors above): the blocks they held are not on disk")
    return f"kvstrata: stopped; cache written down to {disk.path}"


def dtype_phrase(config: Config, stats: dict) -> str:
    """What the weights compute in, and the K/V's dtype where `cache.kv_cache_dtype` keeps them in another."""
    phrase = f"{stats['dtype']}{' (auto)' if config.model.dtype == 'auto' else ''}"
    if stats["kv_cache_dtype"] != stats["dtype"]:
        phrase += f", K/V in {stats['kv_cache_dtype']}"
    return phrase


def _banner(config: Config, async_engine: AsyncEngine, model_id: str, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    engine = async_engine.engine
    stats = async_engine.snapshot.stats if async_engine.snapshot else engine.stats()
    tiers = stats["tiers"]
    dtype = dtype_phrase(config, stats)
    auth = "API key required" if config.server.api_key else "no API key"
    lines = [f"kvstrata {__version__} serving {model_id} ({dtype} on {stats['device']}, {stats['threads']} torch "
             f"thread{'s' if stats['threads'] != 1 else ''}, attention: {stats['attention_backend']}, "
             f"batch-invariant: {'on' if stats['batch_invariant'] else 'off'}"
             f"{' (auto)' if config.model.batch_invariant == 'auto' else ''}, "
             f"context {engine.max_model_len} tokens)",
             f"  listening on http://{url_host}:{port}  (OpenAI API under /v1, {auth}; Prometheus at /metrics)"]
    if config.events is not None:
        lines.append(f"  KV events:   {config.events.endpoint} (replay at {config.events.replay_endpoint})")
    for name in TIER_NAMES:
        tier = tiers.get(name)
        if tier is None:
            lines.append(f"  {name + ' tier:':<13}off")
            continue
        readers = tier["extra"].get("read_processes", 0)
        read_by = f", read by {readers} process{'es' if readers != 1 else ''}" if readers else ""
        if name == "remote":  # sized by the server's maxmemory, not here
            lines.append(f"  {'remote tier:':<13}{tier['extra']['url']} (key prefix {tier['extra']['key_prefix']}"
                         f"{', cluster' if tier['extra']['cluster'] else ''}){read_by}")
            continue
        where = f" at {config.cache.tiers.disk.path}{read_by}" if name == "disk" else ""
        lines.append(f"  {name + ' tier:':<13}{format_bytes(tier['capacity_bytes'])} "
                     f"({tier['capacity_blocks']} blocks of {config.cache.block_size} tokens){where}")
    return "\n".join(lines)
