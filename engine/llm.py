"""The offline Python API: `LLM(config).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from kvstrata.engine.config import Config, load_config
from kvstrata.engine.documents import Document
from kvstrata.engine.llm_engine import CacheReset, LLMEngine
from kvstrata.engine.prompts import render_document
from kvstrata.tiers.names import TIER_NAMES
from kvstrata.engine.receipt import CacheReceipt
from kvstrata.engine.request import Request, RequestFailedError, RequestStatus
from kvstrata.engine.sampling import SamplingParams, TokenLogprobs
from kvstrata.tiers.block_events import BlockEventListener

logger = logging.getLogger("kvstrata")

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    """One sequence sampled from a prompt (vLLM's `CompletionOutput`): `RequestOutput.outputs` holds
    `n` of them, index i sampled with `SamplingParams.for_choice(i)`."""

    index: int
    text: str
    token_ids: list[int]
    # the sum of the sampled tokens' log-probabilities, when `logprobs` was asked for (as vLLM)
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """One finished (or, while streaming, in-flight) request, as the user sees it.

    `outputs` lists its sequences as vLLM does (`outputs[0].text`); the flat fields (`text`,
    `token_ids`, the cache's and the TTFT's) are the first sequence's. With `n` > 1 each sequence is
    an engine request of its own, so each found its own cached tokens: the first usually computes
    the prompt and the others find it cached.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    cached_tokens: int                       # prompt tokens served from any tier (measured)
    cached_tokens_by_tier: dict[str, int]    # {"device": n, "cpu": n, "disk": n, "remote": n}
    ttft_s: float | None                     # arrival to first token, measured
    finish_reason: str | None                # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None     # the stop string or stop token id that ended it, if any
    finished: bool = False
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token in `token_ids`, if the params asked for them
    # one per prompt token after the first (the first has no context to be predicted from), if asked
    prompt_logprobs: list[TokenLogprobs] | None = None
    receipt: CacheReceipt | None = None      # where the TTFT went (engine/receipt.py); None before the first token
    # prompt tokens found in a tier but recomputed instead, by `cache.load_policy`'s choice (measured speeds)
    recomputed_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name for `cached_tokens`."""
        return self.cached_tokens

    @classmethod
    def from_request(cls, r: Request) -> "RequestOutput":
        by_tier = dict(r.cached_tokens_by_tier or dict.fromkeys(TIER_NAMES, 0))
        logprobs = None if r.sampling_params.logprobs is None else list(r.output_logprobs)
        sequence = CompletionOutput(
            index=0, text=r.output_text, token_ids=list(r.output_token_ids), logprobs=logprobs,
            cumulative_logprob=None if logprobs is None else r.cumulative_logprob,
            finish_reason=r.status.value if r.is_finished else None, stop_reason=r.stop_reason)
        # the flat fields are the sequence's own objects: built once per output (a stream builds one a token);
        # the prompt's ids are the request's own list, which nothing changes (a copy per token of a long
        # document's ids cost the engine thread more than the rest of the snapshot)
        return cls(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                   text=sequence.text, token_ids=sequence.token_ids, cached_tokens=sum(by_tier.values()),
                   cached_tokens_by_tier=by_tier, ttft_s=r.ttft_s,
                   finish_reason=sequence.finish_reason, stop_reason=sequence.stop_reason,
                   finished=r.is_finished, num_preemptions=r.num_preemptions,
                   logprobs=logprobs, prompt_logprobs=_prompt_logprobs(r), receipt=r.receipt,
                   recomputed_tokens_by_tier=dict(r.recomputed_tokens_by_tier or dict.fromkeys(by_tier, 0)),
                   outputs=[sequence])

    @classmethod
    def of_sequences(cls, outputs: Sequence["RequestOutput"]) -> "RequestOutput":
        """One prompt's output from its sequences' (one engine request each, in order): the first's,
        listing every sequence in `outputs`."""
        first = outputs[0]
        sequences = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)]
        return dataclasses.replace(first, outputs=sequences, finished=all(o.finished for o in outputs))


def _prompt_logprobs(r: Request) -> list[TokenLogprobs] | None:
    """The request's prompt entries with as many alternatives as it asked for (they are computed, and
    kept by block, with every alternative any request may ask for). Once every entry is there they no
    longer change: cut once and shared by every later snapshot (a 7000-token prompt's entries took
    milliseconds to cut, at every token of the answer)."""
    k = r.sampling_params.prompt_logprobs
    if k is None:
        return None
    if r.shown_prompt_logprobs is not None:
        return r.shown_prompt_logprobs
    shown = [dataclasses.replace(e, top=e.top[:k]) for e in r.prompt_logprobs]
    if not r.needs_prompt_logprobs:
        r.shown_prompt_logprobs = shown
    return shown


class LLM:
    """kvstrata's offline entry point.

        llm = LLM("configs/default.yaml")             # or LLM(load_config(path, overrides))
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    """

    def __init__(self, config: Union[str, Path, dict, Config, None] = None, *,
                 loaded_model: Any = None, events: BlockEventListener | None = None):
        """`config`: a YAML path, a dict, a Config, or None (defaults). `loaded_model` lets several
        engines in one process share one loaded model (same dtype and device). `events` hears every
        block the tiers store, evict and clear; to publish them as vLLM does, pass
        `kvstrata.serving.events.KVEventPublisher(config.events)`; with none given, `kvstrata.LLM`
        gives a config with an `events` section a publisher of its own, closed by `close()`."""
        self.config = config if isinstance(config, Config) else load_config(config)
        self._publisher = None
        if self.config.events is not None and events is None:
            events = self._publisher = self._own_event_publisher(self.config.events)
        try:
            self.engine = LLMEngine(self.config, loaded=loaded_model, block_events=events)
        except BaseException:
            if self._publisher is not None:
                self._publisher.close()
            raise
        self._ids = itertools.count()

    def _own_event_publisher(self, events_config) -> Any:
        """The publisher a config's `events` section asks for: none here, where the engine knows nothing of
        ZMQ; `kvstrata.LLM`, the public face, publishes as `kvstrata serve` does."""
        return None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; prompts are text or token ids. Outputs keep the order.

        An internal error of the engine's that ends a prompt's request (`RequestStatus.FINISHED_ERROR`: a fault
        while admitting it, or in a step it was in) raises `RequestFailedError` naming the prompt, once every
        other request of the call has run to its end; the traceback is in the `kvstrata` log, and the engine goes
        on serving later calls."""
        return self._run(self._normalise_prompts(prompts), sampling_params, cache_salt)

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             cache_salt: str | None = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template
        (rendered as vLLM's `LLM.chat` renders them: see `render_chat` in engine/prompts.py)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendering = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                         template_kwargs=chat_template_kwargs)
        return self._run([(None, self.engine.apply_chat_template(c, **rendering)) for c in conversations],
                         sampling_params, cache_salt)

    def _normalise_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of them")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, self.engine.tokenize(p)))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError("each prompt must be a string or a list of integer token ids")
        return out

    def _run(self, prompts: list[tuple[str | None, list[int]]], sampling_params, cache_salt) -> list[RequestOutput]:
        """One engine request per sequence (`n` per prompt), all validated before any is added, so a
        bad prompt leaves nothing half-scheduled; one output per prompt, in order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = [(text, token_ids, p.for_choice(i))
                    for (text, token_ids), p in zip(prompts, params) for i in range(p.n)]
        requests = [(text, self.engine.validate_request(token_ids, p), p) for text, token_ids, p in requests]
        arrival = time.perf_counter()
        ids = []
        for text, token_ids, p in requests:
            rid = f"gen-{next(self._ids)}"
            self.engine.add_validated_request(rid, token_ids, p, cache_salt=cache_salt, prompt=text,
                                              arrival_time=arrival)
            ids.append(rid)
        finished = self.engine.run_until_finished(ids)
        for rid in ids:
            self.engine.release(rid)
        prompt_of = [k for k, p in enumerate(params) for _ in range(p.n)]
        failed = [(k, r) for k, r in zip(prompt_of, finished) if r.status == RequestStatus.FINISHED_ERROR]
        if failed:
            k, request = failed[0]
            raise RequestFailedError(f"prompt {k} failed: {request.error}" + (
                f" (and {len(failed) - 1} other request(s) of this call)" if len(failed) > 1 else ""))
        sequences = iter([RequestOutput.from_request(r) for r in finished])
        return [RequestOutput.of_sequences([next(sequences) for _ in range(p.n)]) for p in params]

    def cache_document(self, messages: Sequence[dict] | None = None, prompt: str | None = None, *,
                       cache_salt: str | None = None, pin: bool = True) -> Document:
        """Compute and store a document's KV blocks before any question arrives; pinned, they are never
        evicted from the CPU and disk tiers (at most `cache.pin_share` of each).

        Give the start that the questions will share: `messages` whose last message the questions
        extend (rendered open, without the end of turn), or a plain `prompt` they extend. Returns the
        document: its id (stable across restarts), token counts and the blocks each tier holds.
        """
        document = render_document(self.tokenizer, messages=messages, prompt=prompt)
        return self.engine.cache_document(document, cache_salt, pin)

    def list_documents(self) -> list[Document]:
        """Documents cached with `cache_document` or `cache.preload` (and pinned ones from before a restart)."""
        return self.engine.documents.list()

    def unpin_document(self, document_id: str) -> Document:
        """Forget a document: its blocks become ordinary cached blocks, evictable again. KeyError if unknown."""
        return self.engine.documents.unpin(document_id)

    def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Forget every block cached on the device, if no request is running; the lower tiers keep
        theirs (`offload: on_evict` writes them down first, as eviction would). `reset_external=True`
        forgets everything cached instead: every tier (a shared disk or remote tier for everyone
        sharing it), the documents and their pins. Falsy if requests run or a tier could not be cleared."""
        return self.engine.reset_prefix_cache(reset_external)

    def stats(self) -> dict:
        """Per-tier blocks, bytes, hits, misses, evictions; prefix-cache query and hit tokens; moves."""
        return self.engine.stats()

    def close(self) -> None:
        """Flush pending write-downs to disk (so the next process finds them) and release the tiers."""
        try:
            self.engine.close()
        finally:
            if self._publisher is not None:  # after the engine's close, whose write-down it reports
                self._publisher.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
