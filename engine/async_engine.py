"""AsyncEngine: the single-threaded LLMEngine on its own thread, fed by asyncio callers.

One engine thread owns the LLMEngine. It drains a thread-safe inbox of commands (add, abort, stop),
calls `step()` while there is work, and hands each request's progress to the asyncio queue of the
caller that asked for it with `loop.call_soon_threadsafe`: once per event loop per step, with all of
the step's outputs for that loop. With no work it waits on the inbox, waking once a second to publish
a fresh stats snapshot (tiers keep changing while idle: the disk tier's writer commits, another
process shares the store). The asyncio side never touches the engine: it validates requests with
`validate_request` (which reads only fixed limits and the thread-safe grammar cache) and reads the
stats snapshot that the engine thread publishes.

This module knows nothing of HTTP or of how figures are exported: whoever serves the engine reads
`snapshot` and may pass a `RequestListener` to hear of each first token, each later token's gap and
each finish.

Order of operations after a step: publish the stats snapshot, then push the outputs. A client that
has its answer (or its first token) therefore finds its request already counted in the snapshot. Steps
that finish no request and start none publish at most every `BUSY_SNAPSHOT_INTERVAL_S`.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence, TypeVar

from kvstrata.engine.documents import Document
from kvstrata.engine.llm import RequestOutput
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.prompts import RenderedDocument
from kvstrata.engine.receipt import CacheReceipt
from kvstrata.engine.request import Request, RequestFailedError, RequestStatus
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.watchdog import Watchdog
from kvstrata.tiers.base import close_at_exit

logger = logging.getLogger("kvstrata")

T = TypeVar("T")
# How often an idle engine thread republishes its stats snapshot.
IDLE_SNAPSHOT_INTERVAL_S = 1.0
# How often a busy one does between the steps that finish or start answering a request: the stats walk every
# tier (a few tenths of a millisecond with a disk tier), a share of every step if taken after each.
BUSY_SNAPSHOT_INTERVAL_S = 0.25
# At interpreter exit, the longest the requests still running may take to finish before the engine stops anyway.
EXIT_WAIT_S = 30.0


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread saw at one moment; immutable, so other threads may read it freely."""

    stats: dict                      # LLMEngine.stats()
    num_running: int
    num_waiting: int
    taken_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class FinishedRequest:
    """A request that ended, as a listener hears of it."""

    finish_reason: str           # stop, length, abort, error
    e2e_s: float                 # from its arrival to its end
    num_prompt_tokens: int
    num_generated_tokens: int
    # the chain hashes of its full blocks, the prompt's first (a trace of the traffic names prompts by them:
    # kvstrata/trace.py)
    block_hashes: tuple[bytes, ...] = ()
    decode_s: float | None = None  # from its first token to its end (None: it ended before a first token)


class RequestListener(Protocol):
    """Hears of request events as they happen, on the engine thread (so it must be quick)."""

    def on_first_token(self, receipt: CacheReceipt, num_prompt_tokens: int) -> None: ...

    def on_token_gap(self, gap_s: float) -> None:
        """A request's next tokens came `gap_s` after its previous ones (vLLM's inter-token latency)."""

    def on_step(self, num_tokens: int, num_generated_tokens: int) -> None:
        """An engine step ran: it computed `num_tokens` (prompt chunks and decodes) and sampled
        `num_generated_tokens`."""

    def on_finished(self, finished: FinishedRequest) -> None: ...


class _NoListener:
    def on_first_token(self, receipt: CacheReceipt, num_prompt_tokens: int) -> None:
        pass

    def on_token_gap(self, gap_s: float) -> None:
        pass

    def on_step(self, num_tokens: int, num_generated_tokens: int) -> None:
        pass

    def on_finished(self, finished: FinishedRequest) -> None:
        pass


def _finished(request: Request) -> FinishedRequest:
    now = time.perf_counter()
    first = request.first_token_time
    return FinishedRequest(request.status.value, now - request.arrival_time,
                           request.num_prompt_tokens, len(request.output_token_ids),
                           tuple(request.block_hashes), None if first is None else now - first)


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or failed) and takes no new requests."""


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    saw_first_token: bool = False
    num_tokens: int = 0                    # generated tokens delivered so far ...
    last_token_at: float | None = None     # ... the last of them at this time (perf_counter)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        _post(self.loop, [(self.queue, item)])


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """From the engine thread: put each item into its queue on `loop`, in one wake-up of the loop."""
    try:
        loop.call_soon_threadsafe(_put_each, items)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody is listening any more


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    prompt: str | None
    arrival_time: float
    stream: _Stream
    prefill_only: bool = False


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread; its result (or error) goes to `future` on `loop`."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if not self.future.done():  # the caller may have gone away
                (self.future.set_exception(error) if error is not None else self.future.set_result(result))
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the caller's loop is closed


_STOP = object()


class AsyncEngine:
    """Serve an LLMEngine to asyncio code.

        async for output in async_engine.generate(token_ids, SamplingParams(max_tokens=32)):
            ...                                  # RequestOutput snapshots; the last has finished=True
        async_engine.shutdown()                  # finishes in-flight requests, then engine.close()
    """

    def __init__(self, engine: LLMEngine, listener: RequestListener | None = None, watchdog_timeout: float = 0.0):
        """`watchdog_timeout`: seconds without progress of a step or a prefix load before the log says so
        (engine/watchdog.py; `scheduler.watchdog_timeout`); 0: not watched."""
        self.engine = engine
        self.listener: RequestListener = listener or _NoListener()
        # The latest snapshot: replaced whole (one reference assignment), so readers see the old or the new.
        self.snapshot: EngineSnapshot | None = None
        # LLMEngine.stats() as of the close (what writing the cache down at shutdown did); None before,
        # or if closing failed.
        self.final_stats: dict | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._taken: list = []  # commands taken from the inbox during a step, to apply after it
        # Guards `_accepting` together with putting into the inbox, so that no add can land behind _STOP.
        self._lock = threading.Lock()
        self._accepting = True
        self.error: BaseException | None = None  # set if a step failed: the engine is then unusable
        # Owned by the engine thread only.
        self._streams: dict[str, _Stream] = {}
        self._publish_snapshot()
        engine.take_arrivals = self._add_arrivals
        self.watchdog = Watchdog(watchdog_timeout)
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._thread.start()
        # A process that exits without shutting down stops the engine's thread before the engine's parts close
        # themselves (registered after them, this runs first): they are not closed under a step or a write-down.
        self._atexit = close_at_exit(self, "shutdown", EXIT_WAIT_S)

    # ------------------------------------------------------------------ asyncio side

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 request_id: str | None = None, cache_salt: str | None = None, prompt: str | None = None,
                 arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError before anything is queued), then return the request's outputs.

        The request is queued when iteration starts. Each item is a snapshot of the whole request so
        far (its text only ever grows); the last one has `finished=True`. Closing or cancelling the
        iterator before that (a client that went away) aborts the request and frees its blocks.
        """
        prompt_token_ids = self.engine.validate_request(prompt_token_ids, params)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        return self._outputs(_Add(request_id, prompt_token_ids, params, cache_salt, prompt, arrival_time,
                                  _Stream(asyncio.get_running_loop())))

    async def prepare(self, params: SamplingParams) -> None:
        """Work a request needs before it can be validated, done off the event loop: a structured
        request's grammar is compiled (tens of milliseconds for a big schema, without the GIL) on a
        worker thread, so that `generate` finds it cached. ValueError for a schema it cannot follow."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_outputs)

    async def _outputs(self, add: _Add) -> AsyncIterator[RequestOutput]:
        self._submit(add)
        finished = False
        try:
            while not finished:
                output = await _latest(add.stream.queue)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._submit(_Abort(add.request_id), required=False)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between steps (the engine is never touched from
        here); its exceptions are raised here."""
        loop = asyncio.get_running_loop()
        command = _Call(fn, loop, loop.create_future())
        self._submit(command)
        return await command.future

    async def cache_document(self, document: RenderedDocument, cache_salt: str | None, pin: bool) -> Document:
        """Plan (refusing before any work what cannot be done), prefill the document's blocks as a
        request that generates nothing, then record and pin it: `LLMEngine.cache_document`, with the
        other requests' steps going on meanwhile."""
        plan = await self.call(lambda engine: engine.plan_document(document, cache_salt, pin))
        add = _Add(f"document-{uuid.uuid4().hex}", plan.token_ids, SamplingParams(max_tokens=1), plan.cache_salt,
                   None, time.perf_counter(), _Stream(asyncio.get_running_loop()), prefill_only=True)
        async for _ in self._outputs(add):
            pass
        return await self.call(lambda engine: engine.documents.register(plan))

    def _submit(self, command, required: bool = True) -> None:
        with self._lock:
            if self._accepting:
                self._inbox.put(command)
            elif required:
                raise EngineStoppedError(self._stopped_reason())

    def _stopped_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed and takes no more requests: {self.error}"
        return "the engine is shutting down and takes no new requests"

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, let the in-flight ones finish, stop the thread, close the engine
        (which writes the cache down to disk). Safe to call more than once; blocks until done."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._inbox.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            atexit.unregister(self._atexit)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._serve_until_stopped()
        except BaseException as exc:  # a failed step: every caller must hear of it, none may hang
            logger.exception("kvstrata: the engine failed")
            self.error = exc
            self._fail_all(EngineStoppedError(f"the engine failed: {exc}"))
        finally:
            self.watchdog.stop()
            self._refuse_queued_commands()
            self._close_engine()

    def _close_engine(self) -> None:
        try:
            self.engine.close()
            self.final_stats = self.engine.stats()
        except Exception:
            logger.exception("kvstrata: writing the cache down at shutdown failed")

    def _serve_until_stopped(self) -> None:
        stop_requested = False
        while not (stop_requested and not self.engine.has_unfinished_requests()):
            idle = not self.engine.has_unfinished_requests()
            # Idle time writes the cache down to disk in small chunks, checking the inbox between them.
            wrote_down = (idle and not stop_requested and not self._taken and self._inbox.empty()
                          and self._write_down_idle())
            for command in self._take_commands(wait=idle and not stop_requested and not wrote_down):
                if command is _STOP:
                    stop_requested = True
                else:
                    self._apply(command)
            updated = []
            if self.engine.has_unfinished_requests():
                updated = self._step()
                if self.engine.last_step_tokens:  # 0: nothing ran (waiting on a load, or failed)
                    self.listener.on_step(self.engine.last_step_tokens, self.engine.last_step_generated_tokens)
            if self._snapshot_due(updated):
                self._publish_snapshot()
            self._deliver(updated)

    def _step(self) -> list[Request]:
        """One engine step, watched (engine/watchdog.py)."""
        self.watchdog.step_started()
        try:
            return self.engine.step()
        finally:
            self.watchdog.step_ended()
            if self.watchdog.enabled:
                self.watchdog.check_loads(self.engine.kv_manager.loads_in_flight())

    def _snapshot_due(self, updated: list[Request]) -> bool:
        """After a step that finished or started answering a request, whenever idle, else now and then."""
        return (not self.engine.has_unfinished_requests()
                or any(r.is_finished or len(r.output_token_ids) == 1 for r in updated)
                or time.monotonic() - self._snapshot_at >= BUSY_SNAPSHOT_INTERVAL_S)

    def _write_down_idle(self) -> bool:
        try:
            return self.engine.write_down_idle() > 0
        except Exception:  # the cache is best effort: never let it stop the server
            logger.exception("kvstrata: writing the cache down while idle failed")
            return False

    def _add_arrivals(self) -> None:
        """During a step, while the device computes it (`LLMEngine.take_arrivals`): add the requests queued in the
        inbox, up to its first other command, which waits for the step's end with those behind it (aborts and
        calls change what the step is computing; the inbox's order is kept)."""
        while not self._taken:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._apply(command)
            else:
                self._taken.append(command)

    def _take_commands(self, wait: bool) -> list:
        """The commands in the inbox (first those taken during the last step); with `wait`, waits for one, but no
        longer than the idle snapshot interval (the caller republishes the snapshot either way)."""
        commands, self._taken = self._taken, []
        if wait and not commands:
            with contextlib.suppress(queue.Empty):
                commands.append(self._inbox.get(timeout=IDLE_SNAPSHOT_INTERVAL_S))
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            try:
                command.resolve(command.fn(self.engine))
            except Exception as exc:  # the caller's to handle: the engine goes on
                command.resolve(error=exc)
            return
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                request = self.engine.requests.get(command.request_id)
                self.engine.abort_request(command.request_id)
                if request is not None:
                    self.listener.on_finished(_finished(request))
                self.engine.release(command.request_id)
            return
        try:
            self.engine.add_validated_request(command.request_id, command.prompt_token_ids, command.params,
                                              cache_salt=command.cache_salt, prompt=command.prompt,
                                              arrival_time=command.arrival_time, prefill_only=command.prefill_only)
        except ValueError as exc:  # refused: its caller hears why
            command.stream.put(exc)
            return
        except Exception as exc:  # a fault while adding it (nothing is left behind): its caller hears it, none hangs
            logger.exception("kvstrata: request %s could not be added", command.request_id)
            command.stream.put(exc)
            return
        self._streams[command.request_id] = command.stream

    def _deliver(self, updated: list[Request]) -> None:
        """Hand the step's outputs to their callers: one `call_soon_threadsafe` per event loop, since each
        wakes the loop's thread, which then competes with this one for the interpreter lock (with a call
        per request, a decode step beside many streams took several times the engine's own work)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for request in updated:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue
            if request.status == RequestStatus.FINISHED_ERROR:  # its caller hears why; the engine goes on
                self.listener.on_finished(_finished(request))
                del self._streams[request.request_id]
                self.engine.release(request.request_id)
                stream.put(RequestFailedError(f"the engine failed this request: {request.error}"))
                continue
            output = RequestOutput.from_request(request)
            if not stream.saw_first_token and output.receipt is not None:
                stream.saw_first_token = True
                self.listener.on_first_token(output.receipt, request.num_prompt_tokens)
            self._note_tokens(stream, len(request.output_token_ids))
            if request.is_finished:  # heard of before the caller has its answer, as the snapshot is
                self.listener.on_finished(_finished(request))
                del self._streams[request.request_id]
                self.engine.release(request.request_id)
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            _post(loop, items)

    def _note_tokens(self, stream: _Stream, num_tokens: int) -> None:
        """A request's generated tokens now number `num_tokens`: the gap since its previous ones, if any."""
        if num_tokens <= stream.num_tokens:
            return
        now = time.perf_counter()
        if stream.last_token_at is not None:
            self.listener.on_token_gap(now - stream.last_token_at)
        stream.num_tokens, stream.last_token_at = num_tokens, now

    def _publish_snapshot(self) -> None:
        self._snapshot_at = time.monotonic()
        scheduler = self.engine.scheduler
        self.snapshot = EngineSnapshot(stats=self.engine.stats(), num_running=len(scheduler.running),
                                       num_waiting=len(scheduler.waiting))

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already broken; the callers have been told
                pass
        self._streams.clear()

    def _refuse_queued_commands(self) -> None:
        with self._lock:
            self._accepting = False
            for command in self._take_commands(wait=False):
                if isinstance(command, _Add):
                    command.stream.put(EngineStoppedError(self._stopped_reason()))
                elif isinstance(command, _Call):
                    command.resolve(error=EngineStoppedError(self._stopped_reason()))


async def _latest(outputs: asyncio.Queue) -> RequestOutput:
    """The newest output in the queue (each is a whole snapshot, so older ones can be skipped when
    the reader falls behind); an error in the queue is raised."""
    item = await outputs.get()
    while True:
        if isinstance(item, BaseException):
            raise item
        if item.finished or outputs.empty():
            return item
        item = outputs.get_nowait()
