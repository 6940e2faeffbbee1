"""LLMEngine: composes the model, the tiered KV cache and the scheduler; one `step()` at a time.

The engine is single-threaded by design: `add_request`, `abort_request` and `step` are called from
one thread (the LLM API's loop, or the server's engine thread).

`block_events`, if given, hears every block the tiers store, evict and clear (tiers/block_events.py);
the serving layer publishes them. Without it no event is built.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import time
from array import array
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from kvstrata.engine.config import Config, DiskTierConfig, RemoteTierConfig
from kvstrata.engine.costs import StepCost, attention_pairs, kv_reads
from kvstrata.engine.detokenizer import IncrementalDetokenizer
from kvstrata.engine.documents import Document, DocumentPlan, DocumentRegistry
from kvstrata.engine.hashing import BlockHasher, BlockNaming
from kvstrata.engine.kv_manager import KVCacheManager
from kvstrata.engine.model_loader import LoadedModel, load_model, resolve_model
from kvstrata.engine.model_runner import ModelRunner, StepInput
from kvstrata.engine.prompt_logprobs import PromptLogprobCache
from kvstrata.engine.prompts import (RenderedDocument, document_prefix_messages, render_chat, render_document,
                                    tokenize_text)
from kvstrata.engine.request import Request, RequestFailedError, RequestStatus
from kvstrata.engine.sampling import (MAX_LOGPROBS, SamplingParams, adjust_logits, compute_logprobs, make_generator,
                                      sample)
from kvstrata.engine.scheduler import Scheduler, SchedulerOutput
from kvstrata.engine.structured_outputs import GrammarCompiler, GrammarMatcher, mask_logits
from kvstrata.kernels.backends import compiled_products, get_ops, resolve_backend, resolve_batch_invariant
from kvstrata.tiers.base import BlockLayout, close_at_exit
from kvstrata.tiers.block_events import BlockEventListener
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.hierarchy import TierHierarchy
from kvstrata.tiers.record import RecordCodec
from kvstrata.tiers.storage import format_bytes
from kvstrata.tiers.transfer import TransferEngine, default_fill_threads

logger = logging.getLogger("kvstrata")
LOAD_WAIT_S = 0.05  # the longest an otherwise idle step waits for a prefix load to land

# Blocks of prompt log-probabilities kept (engine/prompt_logprobs.py; about 2.7 KB each): enough for
# what the device and the tiers below it hold of the documents being scored, within a bound.
PROMPT_LOGPROB_BLOCKS_PER_DEVICE_BLOCK = 4
MAX_PROMPT_LOGPROB_BLOCKS = 16384
# The start-up probe of the step cost, by device type: a prefill of this many tokens (at most a step's
# budget), a decode over it and a short prefill. A GPU's step has a large fixed cost and a small one per
# token, which the CPU-sized guess the cost starts from misses by orders of magnitude; on a CPU the guess
# is close, and a probe would lengthen every start for little.
PROBE_TOKENS = {"cuda": 2048}
PROBE_SHORT_TOKENS = 16
PROMPT_ROWS_AT_ONCE = 256  # log-softmax over this many prompt rows at a time: a vocabulary-wide copy each


@dataclass
class CacheReset:
    """What `reset_prefix_cache` did; truthy when every tier it was asked to empty is empty."""

    tiers: list[str]                                       # the tiers emptied
    not_cleared: list[str] = field(default_factory=list)   # a tier that could not be (a remote server down)
    busy: bool = False                                     # requests were running: nothing changed

    def __bool__(self) -> bool:
        return not self.busy and not self.not_cleared


@dataclass
class _PromptRows:
    """The packed rows of a step whose logits give prompt logprobs: a row at position p of a prompt
    predicts its token p+1."""

    rows: list[int] = field(default_factory=list)
    owners: list[tuple[Request, int]] = field(default_factory=list)  # (request, position) of each row

    def add(self, request: Request, first_row: int, start: int, stop: int) -> None:
        """The rows of `request`'s positions [start, stop), the first packed at `first_row`."""
        for position in range(start, stop):
            self.rows.append(first_row + position - start)
            self.owners.append((request, position))

    @property
    def count(self) -> int:
        return len(self.rows)


SLOW_DTYPE_FACTOR = 3.0  # a half-precision dtype this many times slower than float32 on a CPU is worth a warning


def cpu_matmul_slowdown(dtype: torch.dtype, size: int = 256, rows: int = 64) -> float:
    """How many times longer the host's CPU multiplies a `rows` x `size` by a `size` x `size` matrix in
    `dtype` than in float32 (best of three each, on the engine's threads): a CPU without native
    bfloat16 or float16 units emulates them, many times slower."""
    def best_s(dt: torch.dtype) -> float:
        a, b = torch.randn(rows, size).to(dt), torch.randn(size, size).to(dt)
        a @ b  # the first call pays for dispatch and allocation
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best_s(dtype) / max(best_s(torch.float32), 1e-9)


def slow_dtype_warning(dtype_name: str, slowdown: float) -> str | None:
    """The warning for a model dtype whose matrix products ran `slowdown` times slower than float32
    on the host's CPU, or None when it is not worth one."""
    if slowdown < SLOW_DTYPE_FACTOR:
        return None
    return (f"model.dtype {dtype_name} on this CPU: its matrix products ran {slowdown:.0f}x slower than float32 "
            f"(no native {dtype_name}); model.dtype float32 (or auto) computes faster here")


def checked_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """`token_ids` as a list of ints, once each is an integer in [0, vocab_size); else a one-line ValueError.

    Checked in C loops (packed as 64-bit integers, then numpy's min and max): on the engine's thread a Python
    loop over a long document's ids (int() of each, an isinstance of each, min, max) took as long as the rest
    of a cached document's lookup. Integers of any kind pass (numpy's too, through `__index__`); floats,
    strings and None do not."""
    message = f"prompt token ids must be integers in [0, {vocab_size})"
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):  # an array would take bytes as raw integers
        raise ValueError(message)
    try:
        packed = array("q", token_ids)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(message) from None
    if not packed:
        raise ValueError("prompt is empty")
    values = np.frombuffer(packed, dtype=np.int64)
    if values.min() < 0 or values.max() >= vocab_size:
        raise ValueError(message)
    return packed.tolist()


def freeze_long_lived_objects() -> None:
    """Leave the objects that exist now out of the garbage collector's full collections: the model's modules, the
    tokenizer, the tiers live as long as the engine, and a full collection walked all of them, a long pause in the
    step it fell in. Collected first, so that no garbage is kept. Process-wide, as vLLM's engine does it;
    `LLMEngine.close` undoes it, and so does the exit of a process that dropped an engine unclosed: objects left
    frozen are never collected at shutdown, and Triton's bindings (imported by torch) then report theirs as
    leaked."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: Config, loaded: LoadedModel | None = None,
                 block_events: BlockEventListener | None = None):
        self.config = config
        self.block_events = block_events
        # Process-wide, so set here, where every entry point (LLM, serve, ask, benchmarks) passes.
        torch.set_num_threads(config.resolved_threads())
        self.device = torch.device(config.resolved_device())
        self.dtype_name = config.resolved_dtype()  # "auto" resolved: what the weights are
        self.dtype = getattr(torch, self.dtype_name)
        self.kv_dtype_name = config.resolved_kv_cache_dtype()  # what the K/V are kept in, in every tier
        self.loaded = loaded or load_model(resolve_model(config.model.name, config.model.load_format),
                                           self.dtype, self.device)
        mc = self.loaded.model_config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(mc.max_model_len, config.model.max_model_len or mc.max_model_len)
        cache = config.cache
        self.block_size = cache.block_size
        self.layout = BlockLayout(mc.num_layers, cache.block_size, mc.num_kv_heads, mc.head_dim,
                                  getattr(torch, self.kv_dtype_name))
        self.hierarchy = self._build_tiers()
        if self.device_capacity_warning:
            logger.warning("kvstrata: %s", self.device_capacity_warning)
        self.attention_backend = resolve_backend(config.model.attention_backend, self.device)
        self.batch_invariant = resolve_batch_invariant(config.model.batch_invariant, self.attention_backend)
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16) and not \
                compiled_products(self.attention_backend, self.dtype, self.batch_invariant):
            warning = slow_dtype_warning(self.dtype_name, cpu_matmul_slowdown(self.dtype))
            if warning:
                logger.warning("kvstrata: %s", warning)
        if config.model.batch_invariant == "auto" and self.batch_invariant:
            logger.info("kvstrata: batch-invariant mode on (model.batch_invariant: auto; it costs about the "
                        "default's time on this CPU's compiled kernels): a cache hit never changes an answer's bits")
        hasher = BlockHasher.for_model(mc.identity, self.dtype_name, cache.block_size, cache.hash,
                                       batch_invariant=self.batch_invariant, kv_dtype=self.kv_dtype_name,
                                       attention=self.attention_backend)
        # how this engine names its blocks, for a router to name a prompt's alike (its /health tells it)
        self.block_naming = BlockNaming(mc.identity, hasher.namespace, hasher.block_size, hasher.algo)
        logprob_blocks = min(PROMPT_LOGPROB_BLOCKS_PER_DEVICE_BLOCK * self.hierarchy.pool.num_blocks,
                             MAX_PROMPT_LOGPROB_BLOCKS)
        sc = config.scheduler
        self.runner = ModelRunner(self.loaded, self.hierarchy.kv_cache,
                                  get_ops(self.attention_backend, batch_invariant=self.batch_invariant))
        if config.model.cuda_graphs and self.device.type == "cuda":
            self.runner.enable_cuda_graphs(sc.max_num_seqs, -(-self.max_model_len // self.block_size), record=True)
            started = time.perf_counter()
            recorded = self.runner.record_all_graphs()  # at start, not on the path of the requests needing them
            logger.info("kvstrata: recorded %d CUDA graphs (decodes up to %d sequences, questions up to %d tokens) "
                        "in %.1f s", len(recorded), sc.max_num_seqs, max(t for t, _ in recorded),
                        time.perf_counter() - started)
        # Steps a graph replays are priced at a graph's fixed cost. On a GPU the cost starts from no per-token guess:
        # from the CPU-sized one, the fit's weak prior, in what the probe's runs leave undecided, held the per-token
        # cost up and the eager fixed cost at 0, and the load policy recomputed much of each hit in an eager step.
        step_cost = StepCost(replay_tokens=self.runner.replay_tokens,
                             **({"per_token_s": 0.0} if self.device.type == "cuda" else {}))
        self.kv_manager = KVCacheManager(self.hierarchy, hasher, cache.block_size,
                                         enable_caching=cache.enable_prefix_caching, load_policy=cache.load_policy,
                                         prompt_logprobs=PromptLogprobCache(logprob_blocks, cache.block_size),
                                         step_cost=step_cost)
        self.kv_manager.probe_lower_tiers()  # seeds the load policy's read costs before any request
        self.documents = DocumentRegistry(self.hierarchy, hasher, cache.block_size, cache.pin_share)
        self.scheduler = Scheduler(self.kv_manager, sc.max_num_batched_tokens, sc.max_num_seqs, policy=sc.policy,
                                   step_target=sc.step_target, long_prefill_share=sc.long_prefill_share)
        self.num_preemptions = 0  # running requests sent back to wait, their blocks freed (stats())
        self.last_step_tokens = self.last_step_generated_tokens = 0  # of the last step that ran (step())
        self.requests: dict[str, Request] = {}
        # Called during each step while the device computes it, before the next step's admission work: a serving
        # loop adds the requests that arrived meanwhile (engine/async_engine.py), which are then looked up and
        # their loads started in the step's shadow rather than at the start of the next step.
        self.take_arrivals: Callable[[], object] | None = None
        self._generators: dict[str, torch.Generator | None] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # The prompt's token ids on the device, for requests with a repetition penalty (it reads them at
        # every sampled token: made once, not from the list at each step).
        self._penalised_prompts: dict[str, torch.Tensor] = {}
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size)  # for structured outputs
        self._grammar_matchers: dict[str, GrammarMatcher] = {}
        self._closed = False
        self._final_stats: dict | None = None  # stats() once closed
        try:
            self._probe_step_cost()
            self._preload_documents()
        except BaseException:
            self.hierarchy.close()
            raise
        freeze_long_lived_objects()
        # A script that never closes its engine still has it closed at exit, whole (registered after the
        # hierarchy's handler, so it runs before it).
        self._atexit = close_at_exit(self)

    # ------------------------------------------------------------------ construction

    def _build_tiers(self) -> TierHierarchy:
        tiers = self.config.cache.tiers
        nbytes = self.layout.block_nbytes
        num_device_blocks = tiers.device.size.to_blocks(nbytes)
        if num_device_blocks < 1:
            raise ValueError(f"cache.tiers.device.size: {tiers.device.size} holds no block of "
                             f"{nbytes} bytes")
        disk_readers = self._read_processes(None if tiers.disk is None or tiers.disk.size.is_off else tiers.disk)
        remote_readers = self._read_processes(tiers.remote)
        # With the KV cache in host memory the tiers' readers copy blocks straight into it: it is shared.
        shared = disk_readers + remote_readers > 0 and self.device.type == "cpu"
        kv_cache = self._allocate("cache.tiers.device.size", num_device_blocks,
                                  lambda: self._allocate_kv_cache(num_device_blocks, shared))
        pool = BlockPool(num_device_blocks, enable_caching=self.config.cache.enable_prefix_caching)
        cpu = disk = remote = None
        if self.config.cache.enable_prefix_caching:
            if tiers.cpu is not None and not tiers.cpu.size.is_off:
                num_cpu_blocks = tiers.cpu.size.to_blocks(nbytes)
                if num_cpu_blocks < 1:
                    raise ValueError(f"cache.tiers.cpu.size: {tiers.cpu.size} holds no block of {nbytes} bytes")
                pin = tiers.cpu.pinned and self.device.type == "cuda"
                cpu = self._allocate("cache.tiers.cpu.size", num_cpu_blocks,
                                     lambda: CpuTier(self.layout, num_cpu_blocks, pin_memory=pin))
            if tiers.disk is not None and not tiers.disk.size.is_off:
                # a block count means that many stored blocks, each a record: a small header and the payload
                capacity = tiers.disk.size.to_bytes(RecordCodec(self.layout).record_nbytes)
                disk = DiskTier(self.layout, str(tiers.disk.path), capacity, read_processes=disk_readers)
            if tiers.remote is not None:
                # Connects on first use: a server that is down now is a run of misses, not a failed start.
                from kvstrata.tiers.remote import RemoteTier  # the `remote` extra: imported only when used
                r = tiers.remote
                remote = RemoteTier(self.layout, r.url, cluster=r.cluster, key_prefix=r.key_prefix,
                                    timeout=r.timeout, ttl=r.ttl,
                                    queue_bytes=r.queue_size.to_bytes(RecordCodec(self.layout).record_nbytes),
                                    read_processes=remote_readers)
        # On CUDA the readers write into the transfer engine's pinned staging: it is shared.
        transfers = TransferEngine(kv_cache, shared_staging=disk_readers + remote_readers > 0)
        if cpu is not None or disk is not None or remote is not None:
            transfers.allocate_staging()  # now: on the first write-down's path it stalled the step beside it
        for tier in (disk, remote):  # mapped by the readers now: neither the first load nor the start-up probe waits
            if tier is not None:
                tier.share(kv_cache, *transfers.shared_host_buffers())
        return TierHierarchy(pool, kv_cache, cpu, disk, self.config.cache.offload, transfers=transfers,
                             remote=remote, event_listener=self.block_events,
                             offload_answers=self.config.cache.offload_answers)

    def _allocate_kv_cache(self, num_blocks: int, shared: bool) -> torch.Tensor:
        if shared:
            try:
                return self.layout.allocate(num_blocks, self.device, shared=True)
            except OSError as exc:  # no anonymous memory files here (a sandbox): the reads stay in this process
                logger.warning("kvstrata: cannot put the KV cache in shared memory (%s); the disk and remote tiers' "
                               "blocks are read in this process", exc)
        return self.layout.allocate(num_blocks, self.device)

    def _read_processes(self, tier: DiskTierConfig | RemoteTierConfig | None) -> int:
        """The reader processes of the disk or the remote tier (`tier`: its config, None if off): by default one per
        fill thread of the transfer engine (as many as it will have on this device)."""
        if not self.config.cache.enable_prefix_caching or tier is None:
            return 0
        if tier.read_processes is not None:
            return tier.read_processes
        return default_fill_threads(on_gpu=self.device.type == "cuda")

    @property
    def device_capacity_warning(self) -> str | None:
        """What a user must hear at start-up when the device tier cannot hold one request of the full
        context (a request must fit on the device, so longer ones are refused), else None."""
        tokens = self.hierarchy.pool.num_blocks * self.block_size
        if tokens >= self.max_model_len:
            return None
        needed = -(-self.max_model_len // self.block_size) * self.layout.block_nbytes
        return (f"the device tier holds {tokens} tokens, less than the {self.max_model_len}-token context: longer "
                f"requests are refused (cache.tiers.device.size of at least {format_bytes(needed)} holds one, or "
                f"lower model.max_model_len)")

    def _allocate(self, key: str, num_blocks: int, allocate):
        """Run `allocate`; memory the config check saw free but that is gone by now (another process
        took it) is one line naming the tier's key, not a traceback."""
        try:
            return allocate()
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise ValueError(f"{key}: cannot allocate {num_blocks} blocks of {self.layout.block_nbytes} bytes "
                             f"({reason})") from None

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str) -> list[int]:
        return tokenize_text(self.tokenizer, prompt)

    def apply_chat_template(self, messages: Sequence[dict], **rendering) -> list[int]:
        """`rendering`: `render_chat`'s options (the reply's prompt, an open last message, template variables)."""
        return render_chat(self.tokenizer, messages, **rendering)

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Everything that can be wrong with a request, checked before any work is done; returns the prompt's
        token ids as a list of ints."""
        if params.n != 1:
            raise ValueError(f"n must be 1 for one engine request (got {params.n}): LLM.generate and the server "
                             f"run a request per sequence, with params.for_choice(i)")
        vocab = self.loaded.model_config.vocab_size
        prompt_token_ids = checked_token_ids(prompt_token_ids, vocab)
        n = len(prompt_token_ids)
        outside = [t for t in params.token_ids_named if t >= vocab]
        if outside:
            field = "stop_token_ids" if outside[0] in params.stop_token_ids else "logit_bias"
            raise ValueError(f"{field} names token id {outside[0]}, which is not in the model's vocabulary [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens and max_tokens is {params.max_tokens}: "
                             f"{n + params.max_tokens} exceeds the model's context of {self.max_model_len} tokens")
        blocks_needed = -(-(n + params.max_tokens) // self.block_size)
        if blocks_needed > self.hierarchy.pool.num_blocks:
            raise ValueError(f"cache.tiers.device.size: the request needs {blocks_needed} blocks but the device "
                             f"tier holds {self.hierarchy.pool.num_blocks}")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a schema it cannot follow is refused now (cached)
        return prompt_token_ids

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    cache_salt: str | None = None, prompt: str | None = None,
                    arrival_time: float | None = None, prefill_only: bool = False) -> Request:
        """Check the request (`validate_request`) and queue it; ValueError, with nothing queued, if it is refused."""
        prompt_token_ids = self.validate_request(prompt_token_ids, params)
        return self.add_validated_request(request_id, prompt_token_ids, params, cache_salt, prompt, arrival_time,
                                          prefill_only)

    def add_validated_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              cache_salt: str | None = None, prompt: str | None = None,
                              arrival_time: float | None = None, prefill_only: bool = False) -> Request:
        """`add_request` of a prompt that `validate_request` returned, with the params it accepted, not checked
        again: the front ends (the server's, `LLM.generate`) validate before queueing, on their own thread, and the
        engine's thread, which every step waits for, only adds."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_token_ids, params, cache_salt=cache_salt, prompt=prompt,
                          prefill_only=prefill_only)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        # Everything that can fail comes first: a refused request leaves nothing behind.
        generator = make_generator(params, self.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens,
                                             include_stop=params.include_stop_str_in_output,
                                             skip_special_tokens=params.skip_special_tokens)
        if params.structured_outputs is not None:
            self._grammar_matchers[request_id] = self.grammars.matcher(params.structured_outputs)
        self.requests[request_id] = request
        self._generators[request_id] = generator
        self._detokenizers[request_id] = detokenizer
        if params.repetition_penalty != 1.0:
            self._penalised_prompts[request_id] = torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def run_until_finished(self, request_ids: Sequence[str]) -> list[Request]:
        """Step until nothing is left to do; returns the requests named. An error (or an interrupt)
        aborts them first, so nothing is left half-scheduled."""
        try:
            while self.has_unfinished_requests():
                self.step()
        except BaseException:
            for rid in request_ids:
                self.abort_request(rid)
            raise
        return [self.requests[rid] for rid in request_ids]

    # ------------------------------------------------------------------ documents

    def plan_document(self, document: RenderedDocument, cache_salt: str | None = None,
                      pin: bool = True) -> DocumentPlan:
        """Check a document can be cached (fits the context and the device, the pin bound) before
        any work; ValueError (one line) if not."""
        if not self.config.cache.enable_prefix_caching:
            raise ValueError("caching a document needs cache.enable_prefix_caching: true")
        self.validate_request(document.token_ids, SamplingParams(max_tokens=1))
        return self.documents.plan(document, cache_salt, pin)

    def add_document_request(self, request_id: str, plan: DocumentPlan, arrival_time: float | None = None) -> Request:
        """The prefill that computes a planned document's blocks (it generates no token; `plan_document` checked them)."""
        return self.add_validated_request(request_id, plan.token_ids, SamplingParams(max_tokens=1),
                                          cache_salt=plan.cache_salt, arrival_time=arrival_time, prefill_only=True)

    def cache_document(self, document: RenderedDocument, cache_salt: str | None = None, pin: bool = True) -> Document:
        """Compute and store a document's blocks (pinned if `pin`), stepping until they are; returns it."""
        plan = self.plan_document(document, cache_salt, pin)
        request_id = f"document-{plan.document_id}-{time.monotonic_ns()}"
        self.add_document_request(request_id, plan)
        try:
            (request,) = self.run_until_finished([request_id])
        finally:
            self.release(request_id)
        if request.status == RequestStatus.FINISHED_ERROR:  # its blocks were never computed: nothing to register
            raise RequestFailedError(f"caching the document failed: {request.error}")
        return self.documents.register(plan)

    def _preload_documents(self) -> None:
        """`cache.preload`: every file cached (and pinned) as `kvstrata ask` renders its document."""
        for k, entry in enumerate(self.config.cache.preload):
            key = f"cache.preload.{k}.file"
            try:
                text = entry.file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"{key}: cannot read {str(entry.file)!r} as UTF-8 text ({exc})") from None
            try:
                document = render_document(self.tokenizer, messages=document_prefix_messages(text))
                doc = self.cache_document(document, entry.cache_salt, entry.pin)
            except ValueError as exc:
                raise ValueError(f"{key}: {entry.file.name}: {exc}") from None
            logger.info("kvstrata: preloaded %s as %s (%d tokens, %s)", entry.file.name, doc.id, doc.num_tokens,
                        "pinned" if doc.pinned else "not pinned")

    def _probe_step_cost(self) -> None:
        """Seed the step cost (it caps steps and prices recomputing) with timed runs of the model on
        throwaway tokens in free blocks: two prefills of different lengths, a decode over the longer and a
        short prefill, after one untimed round that compiles the kernels (a first request does not pay for
        it). Without it the first steps on a GPU are priced by a CPU-sized guess, and a long prompt alone is
        cut into many short steps. Two eager prefills of different lengths tell their fixed cost from their cost
        per token."""
        bs = self.block_size
        if self.device.type not in PROBE_TOKENS:
            return
        free_tokens = self.hierarchy.pool.num_free_blocks * bs
        n = min(PROBE_TOKENS[self.device.type], self.scheduler.max_num_batched_tokens, free_tokens - 1,
                self.max_model_len - 1)
        if n < PROBE_SHORT_TOKENS:
            return  # no room for a probe: the first steps teach the cost
        blocks = self.hierarchy.pool.get_new_blocks(-(-(n + 1) // bs))
        try:
            block_ids = [b.block_id for b in blocks]
            runs = [(0, n), (0, n // 2), (n, 1), (0, PROBE_SHORT_TOKENS)]  # (context, new tokens)
            for _ in self._timed_probe_runs(block_ids, runs):  # untimed: compiles and warms up
                pass
            for (context, new), seconds in zip(runs, self._timed_probe_runs(block_ids, runs)):
                self.kv_manager.step_cost.observe(new, seconds, attention_pairs(new, context), kv_reads(new, context),
                                            replayed=self.runner.last_step_replayed)
        finally:
            self.hierarchy.pool.free_blocks(blocks)  # never hashed: their K/V are garbage nobody reads

    def _timed_probe_runs(self, block_ids: list[int], runs: list[tuple[int, int]]):
        """Seconds of each (context, new tokens) run, the device waited for as a sampling step waits."""
        bs = self.block_size
        for context, new in runs:
            positions = torch.arange(context, context + new)
            step = StepInput(input_ids=positions % self.loaded.model_config.vocab_size, positions=positions,
                             slot_mapping=torch.tensor(block_ids)[positions // bs] * bs + positions % bs,
                             block_tables=[block_ids], query_start_loc=[0, new], seq_lens=[context + new],
                             logits_indices=[new - 1])
            started = time.perf_counter()
            self.runner.execute(step).argmax(dim=-1).tolist()  # reads the result back, as `sample` does
            yield time.perf_counter() - started

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """Schedule, run the model once, sample; returns the requests that got a token or finished.

        An internal error fails only the requests it concerns, which are returned finished with `FINISHED_ERROR`
        and `Request.error` saying what failed (logged once, with its traceback); the engine goes on with the
        others: an error while one request is handled on its own (its lookup, admission, blocks:
        `Scheduler.fail`) fails that request, one in the step's model run or sampling fails the step's requests
        (`_fail_step`), and one in scheduling that no single request's handling raised fails every request
        (none can be told apart: `_fail_unfinished`)."""
        self.last_step_tokens = self.last_step_generated_tokens = 0
        try:
            out = self.scheduler.schedule()
        except Exception as exc:
            return self._fail_unfinished(exc)
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            # Nothing can run until a prefix load lands: wait for one (briefly, so that a caller
            # feeding new requests between steps is not kept waiting).
            self.kv_manager.wait_for_loads(timeout=LOAD_WAIT_S)
            return self._take_failed()
        try:
            updated = self._run_step(out)
        except Exception as exc:
            updated = self._fail_step(out, exc)
        return updated + self._take_failed()

    def _take_failed(self) -> list[Request]:
        """The requests the scheduler failed since the last step, forgotten here as a finished one is."""
        failed = self.scheduler.take_failed()
        for request in failed:
            self._drop_request_state(request.request_id)
        return failed

    def _fail_unfinished(self, error: Exception) -> list[Request]:
        """Scheduling failed outside any one request's handling: every unfinished request ends with
        `FINISHED_ERROR`, let go as an abort is, and the engine is left empty to serve new ones."""
        logger.error("kvstrata: scheduling failed; the %d unfinished requests end with an error, the engine goes on",
                     sum(not r.is_finished for r in self.requests.values()), exc_info=error)
        failed = [r for r in self.requests.values() if not r.is_finished]
        for request in failed:
            request.error = f"internal error while scheduling ({type(error).__name__})"
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return failed + self._take_failed()

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> list[Request]:
        """The step's model run or sampling failed: each request in it that has not finished ends with
        `FINISHED_ERROR`. Blocks the step was to compute, cached when they were allocated, are forgotten first if
        the model did not run (their K/V were never written): no later request may be served them."""
        logger.error("kvstrata: a step of %d requests failed; they end with an error, the engine goes on",
                     len(out.scheduled), exc_info=error)
        if not out.computed:
            for s in out.scheduled:
                self.kv_manager.uncache_from(s.request, s.context)
        if self.device.type == "cuda":  # nothing launched may still write a block about to be free
            with contextlib.suppress(Exception):
                torch.cuda.current_stream(self.device).synchronize()
        batch = list({id(s.request): s.request for s in out.scheduled}.values())
        for request in batch:
            if not request.is_finished:
                request.error = f"internal error while computing its step ({type(error).__name__})"
                self._finish(request, RequestStatus.FINISHED_ERROR)
        self.hierarchy.flush_pending()
        return batch

    def _run_step(self, out: SchedulerOutput) -> list[Request]:
        """Run the scheduled step: the model, then sampling; returns the requests that got a token or finished."""
        started = time.perf_counter()
        step_input, prompt_rows = self._build_step_input(out)
        logits = self.runner.execute(step_input)
        sampled_logits = logits[:len(logits) - prompt_rows.count]
        if prompt_rows.count:
            self._record_prompt_logprobs(logits[len(sampled_logits):], prompt_rows)
        self.scheduler.update_after_step(out)
        prefilled = [s.request for s in out.scheduled if s.samples and s.request.prefill_only]
        sampling = [s.request for s in out.scheduled if s.samples and not s.request.prefill_only]
        token_ids = self._sample(sampling, sampled_logits) if sampling else None
        # The next step's admission work that does not depend on this step's tokens, done while the device
        # computes them (on a CPU the step is computed already: the same work, only earlier).
        prepare_started = time.perf_counter()
        if self.take_arrivals is not None:
            self.take_arrivals()
        self.scheduler.prepare_next_step()
        prepare_s = time.perf_counter() - prepare_started
        if sampling:
            logprobs = compute_logprobs(sampled_logits, token_ids, [r.sampling_params.logprobs for r in sampling])
            token_id_list = self._read_back(token_ids)
            now = time.perf_counter()
            for request, token_id, token_logprobs in zip(sampling, token_id_list, logprobs):
                if token_logprobs is not None:
                    request.append_logprobs(token_logprobs)
                self._append_token(request, token_id, now)
        # What the step computed (prompt chunks and decodes) and sampled: vLLM's tokens per engine step.
        self.last_step_tokens, self.last_step_generated_tokens = out.num_tokens, len(sampling)
        # The step's measured cost prices waiting work and caps later steps (scheduler.step_target).
        # A sampling step has waited for the device (`sample` reads the tokens back); a prefill chunk
        # waits here, or the cost would never learn from one on a GPU (its time is the device's).
        # A step with prompt rows also ran the vocabulary projection over them: not a step the model prices.
        if not prompt_rows.count:
            if not sampling and self.device.type == "cuda":  # this stream only: never a transfer's copies
                torch.cuda.current_stream(self.device).synchronize()
            step_s = time.perf_counter() - started
            if self.device.type != "cuda":  # computed before the next step's admission work began: not its cost
                step_s -= prepare_s
            self.scheduler.observe_step(out, step_s, replayed=self.runner.last_step_replayed)
        # A document's blocks are computed: nothing to generate. Freed only now that the step has been read back
        # (or waited for): a load started in the step's shadow may be given any free block, and copies into it at
        # once, beside the step (tiers/transfer.py).
        for request in prefilled:
            self._finish(request, RequestStatus.FINISHED_LENGTH)
        # The step computed the K/V of the blocks cached at allocation: now they can go down (the
        # transfer engine copies them in the background). A block reused before its copy is done is
        # waited for by the pool's eviction hook, so nothing is lost.
        self.hierarchy.flush_pending()
        return sampling + prefilled

    def _sample(self, sampling: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Each request's next token id from its row of `logits` (penalties, grammar and sampling parameters
        applied); on a GPU, launched and not yet read back."""
        params = [r.sampling_params for r in sampling]
        prompts = [self._penalised_prompts.get(r.request_id, r.prompt_token_ids) for r in sampling]
        adjusted = adjust_logits(logits, params, prompts, [r.output_token_ids for r in sampling],
                                 self.loaded.model_config.eos_token_ids)
        adjusted = mask_logits(adjusted, [self._grammar_matchers.get(r.request_id) for r in sampling], raw=logits)
        return sample(adjusted, params, [self._generators[r.request_id] for r in sampling])

    @staticmethod
    def _read_back(token_ids: torch.Tensor) -> list[int]:
        """The sampled ids on the host. On a GPU this waits for the step's kernels, so the ids are read back
        before anything is timed: a token's time is when it exists, not when its step was launched (a step's
        kernels are queued in about the same time whatever they compute)."""
        return token_ids.tolist()

    def _build_step_input(self, out: SchedulerOutput) -> tuple[StepInput, _PromptRows]:
        """The step's packed input. Its logits rows: each sampling request's last new token, in
        `out.scheduled`'s order, then the prompt rows (`_PromptRows`). Built in lists and a few numpy
        operations over the whole step: a decode step's host work is on the step's path, and small
        tensor operations per sequence cost several microseconds each."""
        bs = self.block_size
        tables = [self.kv_manager.get_block_ids(s.request) for s in out.scheduled]
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        input_ids, positions, seq_lens, logits_indices = [], [], [], []
        prompt_rows = _PromptRows()
        query_start_loc = [0]
        for row, (s, table) in enumerate(zip(out.scheduled, tables)):
            req = s.request
            start, stop = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            block_tables[row, :len(table)] = table
            input_ids += req.token_ids(start, stop)
            positions += range(start, stop)
            seq_lens.append(stop)
            if req.needs_prompt_logprobs:
                prompt_rows.add(req, query_start_loc[-1], start, min(stop, req.num_prompt_tokens - 1))
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            if s.samples and not req.prefill_only:
                logits_indices.append(query_start_loc[-1] - 1)
        position = np.array(positions, dtype=np.int64)
        row_of_token = np.repeat(np.arange(len(tables)), np.diff(query_start_loc))
        slot_mapping = block_tables[row_of_token, position // bs].astype(np.int64) * bs + position % bs
        step_input = StepInput(input_ids=torch.tensor(input_ids, dtype=torch.int64),
                               positions=torch.from_numpy(position), slot_mapping=torch.from_numpy(slot_mapping),
                               block_tables=torch.from_numpy(block_tables), query_start_loc=query_start_loc,
                               seq_lens=seq_lens, logits_indices=logits_indices + prompt_rows.rows)
        return step_input, prompt_rows

    def _record_prompt_logprobs(self, logits: torch.Tensor, prompt_rows: _PromptRows) -> None:
        """Each prompt row's log-probability of the prompt's next token, with every alternative a
        request may ask for (the entries are kept by block for later requests: a request's outputs
        show its own number). A row its request already has an entry for (a prompt recomputed after
        a preemption, or one whose next block came from the cache) is not recorded again."""
        targets = torch.tensor([r.prompt_token_ids[p + 1] for r, p in prompt_rows.owners])
        entries = []
        for start in range(0, len(targets), PROMPT_ROWS_AT_ONCE):
            rows = slice(start, start + PROMPT_ROWS_AT_ONCE)
            entries += compute_logprobs(logits[rows], targets[rows], [MAX_LOGPROBS] * len(targets[rows]))
        for (request, position), entry in zip(prompt_rows.owners, entries):
            if position == len(request.prompt_logprobs):
                request.prompt_logprobs.append(entry)
        for request in {id(r): r for r, _ in prompt_rows.owners}.values():
            self.kv_manager.prompt_logprobs.store(request)

    def _append_token(self, request: Request, token_id: int, now: float) -> None:
        if request.first_token_time is None:
            request.set_first_token_time(now)
        request.output_token_ids.append(token_id)
        params = request.sampling_params
        detok = self._detokenizers[request.request_id]
        is_eos = token_id in self.loaded.model_config.eos_token_ids and not params.ignore_eos
        # (the sampler keeps both out of the first min_tokens tokens)
        is_stop_token = token_id in params.stop_token_ids
        at_limit = len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len
        json_done = self._follow_grammar(request, token_id)
        # the text of a stop token or end of sequence is not part of the answer unless asked for (vLLM's rule)
        ended_by_token = (is_stop_token or is_eos) and not params.include_stop_str_in_output
        shown = request.output_token_ids[:-1] if ended_by_token else request.output_token_ids
        request.output_text, hit_stop = detok.update(shown, final=is_eos or is_stop_token or at_limit or json_done)
        if hit_stop is not None:
            request.stop_reason = hit_stop
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        elif is_stop_token:
            request.stop_reason = token_id
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        elif is_eos or json_done:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        elif at_limit:
            self._finish(request, RequestStatus.FINISHED_LENGTH)

    def _follow_grammar(self, request: Request, token_id: int) -> bool:
        """Move the request's grammar (if it has one) past its new token; True once its JSON is complete."""
        matcher = self._grammar_matchers.get(request.request_id)
        if matcher is None:
            return False
        if not matcher.accept(token_id):  # the mask allowed it: the grammar and the mask disagree
            logger.warning("kvstrata: request %s: token %d breaks its structured output; ending it",
                           request.request_id, token_id)
            return True
        return matcher.complete

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self._drop_request_state(request.request_id)

    def _drop_request_state(self, request_id: str) -> None:
        """What the engine keeps for a request while it runs (the scheduler has let it go)."""
        self._grammar_matchers.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        self._penalised_prompts.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its outputs have been taken)."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]

    # ------------------------------------------------------------------ stats and shutdown

    def stats(self) -> dict:
        """What the engine counts, all measured. Units are in the names; each counter has one definition:

        - `prefix_cache.query_tokens`: prompt tokens of admitted requests; `prefix_cache.hit_tokens[tier]`:
          those served from each tier. Both are counted once per request, at its first admission (what the
          request reports as `cached_tokens_by_tier`): a retried admission is not counted again; a tail
          loading beside the prefix counts when it lands (or, preempted before, where the retry finds it).
        - `prefix_cache.recomputed_tokens[tier]`: prompt tokens found in each tier at lookup that the load
          policy chose to recompute rather than load (what requests report as `recomputed_tokens_by_tier`),
          counted the same way.
        - `load_policy`: `cache.load_policy` and the estimates it decides with, all measured: each lower
          tier's delivered read bandwidth and per-load latency (seeded by a probe at start-up, then from
          promotions), and the step cost fit (`overhead_s + per_token_s * tokens + per_pair_s * attention
          pairs`, engine/costs.py; `replayed_overhead_s` instead of `overhead_s` for a step replayed as a CUDA
          graph).
        - `tiers.device.hits` / `misses`: the same hits in blocks; misses are the admitted requests'
          blocks that could have hit (full blocks before the last prompt token) and the device did
          not serve. `tiers.cpu|disk|remote.hits|misses|corrupt`: blocks each lower tier's reads served,
          missed, or found corrupt, counted by the tier itself.
        - `promotions[tier]`: blocks copied up to the device from each lower tier and used in a prefix.
        - `promotion_failures`: blocks found below the device at lookup that could not be served when
          loaded (gone, corrupt, a fault); the request recomputed from there.
        - `write_downs[tier]`: blocks handed down to each lower tier.
        - `device_evictions`: cached device blocks whose slot was reused.
        - `num_preemptions`: times a running request was sent back to wait, its blocks freed, for room.
        - `prompt_logprob_cache`: blocks of prompt log-probabilities kept, and blocks of them given to
          requests asking for their prompt's (which then skip computing those blocks when cached).
        """
        if self._final_stats is not None:
            return self._final_stats
        h = self.hierarchy.stats()
        tiers = {name: asdict(s) for name, s in h["tiers"].items()}
        counters = asdict(h["counters"])
        prefix = self.kv_manager.stats()
        tiers["device"]["hits"] = prefix.hit_blocks["device"]
        tiers["device"]["misses"] = prefix.query_blocks - prefix.hit_blocks["device"]
        return {
            "tiers": tiers,
            "prefix_cache": {"query_tokens": prefix.query_tokens,
                             "hit_tokens": {t: n * self.block_size for t, n in prefix.hit_blocks.items()},
                             "recomputed_tokens": {t: n * self.block_size for t, n in prefix.recomputed_blocks.items()}},
            "load_policy": self._load_policy_stats(),
            "promotions": counters["promotions"],
            "promotion_failures": counters["promotion_failures"],
            "write_downs": counters["write_downs"],
            "device_evictions": counters["device_evictions"],
            "num_preemptions": self.num_preemptions,
            "prompt_logprob_cache": {"blocks": len(self.kv_manager.prompt_logprobs),
                                     "blocks_served": self.kv_manager.prompt_logprobs.blocks_served},
            "corrupt": {name: s.get("corrupt", 0) for name, s in tiers.items()},
            "block_bytes": self.layout.block_nbytes,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "prefix_caching": self.config.cache.enable_prefix_caching,
            "hash": self.config.cache.hash,
            "model": self.config.model.name,
            "dtype": self.dtype_name,
            "kv_cache_dtype": self.kv_dtype_name,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "attention_backend": self.attention_backend,
            "batch_invariant": self.batch_invariant,
        }

    def _load_policy_stats(self) -> dict:
        kv = self.kv_manager
        step = kv.step_cost
        return {"policy": kv.load_policy,
                "read_bytes_per_s": {t: c.bytes_per_s for t, c in kv.read_costs.items()},
                "read_latency_s": {t: c.latency_s for t, c in kv.read_costs.items()},
                "step_cost": {"overhead_s": step.overhead_s, "replayed_overhead_s": step.replayed_overhead_s,
                              "per_token_s": step.per_token_s, "per_pair_s": step.per_pair_s}}

    def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Forget every block cached on the device (vLLM's name), if no request holds one; the lower
        tiers keep theirs (`offload: on_evict` writes them down first, as eviction would). With
        `reset_external` (vLLM's name), forget everything cached instead: every tier's blocks (a shared
        disk or remote tier's for everyone sharing it), the documents and their pins, and the prompt
        log-probabilities. Falsy while requests run (nothing changed) or if a tier could not be cleared."""
        if not reset_external:
            ok = self.hierarchy.clear_device_cache()
            return CacheReset(tiers=["device"] if ok else [], busy=not ok)
        not_cleared = self.hierarchy.clear_every_tier()
        if not_cleared is None:
            return CacheReset(tiers=[], busy=True)
        self.documents.forget_all()
        self.kv_manager.prompt_logprobs.clear()
        for name in not_cleared:
            logger.warning("%s tier: could not be cleared (see its faults); it keeps its blocks", name)
        tiers = ["device", *(tier.name for tier in self.hierarchy.lower_tiers)]
        return CacheReset(tiers=[t for t in tiers if t not in not_cleared], not_cleared=not_cleared)

    def write_down_idle(self, max_blocks: int = 64) -> int:
        """While idle, write up to `max_blocks` cached blocks the disk tier lacks down to it, so a
        killed server loses little. Returns how many; 0 when the disk tier holds everything."""
        return self.hierarchy.persist(max_blocks=max_blocks, wait=False)

    def close(self) -> None:
        """Write everything cached that the disk tier lacks down to it, then release the tiers.
        `stats()` still answers afterwards: the figures as of the close, write failures included."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self.hierarchy.persist()  # waits until the disk tier has committed, or counted as failed, each write
        self._final_stats = self.stats()
        self.hierarchy.close()
        gc.unfreeze()  # what this engine held may be collected again (another engine's objects too, until it freezes)

