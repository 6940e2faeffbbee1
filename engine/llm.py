"""The offline Python API: `LLM(config).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from kvstrata.engine.config import Config, load_config
from kvstrata.engine.documents import Document
from kvstrata.engine.llm_engine import CacheReset, LLMEngine
from kvstrata.engine.prompts import check_text, render_document
from kvstrata.tiers.names import TIER_NAMES
from kvstrata.engine.receipt import CacheReceipt
from kvstrata.engine.request import Request, RequestFailedError, RequestStatus
from kvstrata.engine.sampling import SamplingParams, TokenLogprobs
from kvstrata.tiers.block_events import BlockEventListener

logger = logging.getLogger("kvstrata")

Prompt = Union[str, Sequence[int], dict]  # text, token ids, or vLLM's TextPrompt or TokensPrompt


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
        self._closed = False
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

    def get_tokenizer(self):
        """vLLM's name for `tokenizer`."""
        return self.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 cache_salt: str | None = None, *, use_tqdm: Union[bool, Callable] = True,
                 lora_request: None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; prompts are text or token ids, or vLLM's dicts of either
        (TextPrompt `{"prompt": text}`, TokensPrompt `{"prompt_token_ids": ids}`, either with its own
        `"cache_salt"`; `cache_salt` here salts the prompts without one). Outputs keep the order. `use_tqdm`
        and `lora_request` are vLLM's, accepted so that its scripts run: no progress bar is shown, and only
        `lora_request=None` is taken (kvstrata has no LoRA).

        An internal error of the engine's that ends a prompt's request (`RequestStatus.FINISHED_ERROR`: a fault
        while admitting it, or in a step it was in) raises `RequestFailedError` naming the prompt, once every
        other request of the call has run to its end; the traceback is in the `kvstrata` log, and the engine goes
        on serving later calls."""
        self._check_open()
        prompts = _prompt_list(prompts)
        params = _call_params(len(prompts), sampling_params, cache_salt, use_tqdm, lora_request)
        return self._run([self._tokenized(k, p, cache_salt) for k, p in enumerate(prompts)], params)

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             cache_salt: str | None = None, *, use_tqdm: Union[bool, Callable] = True, lora_request: None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template
        (rendered as vLLM's `LLM.chat` renders them: see `render_chat` in engine/prompts.py)."""
        self._check_open()
        conversations = _conversations(messages)
        params = _call_params(len(conversations), sampling_params, cache_salt, use_tqdm, lora_request)
        check_bool("add_generation_prompt", add_generation_prompt)
        check_bool("continue_final_message", continue_final_message)
        _check_template_kwargs(chat_template_kwargs)
        rendering = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                         template_kwargs=chat_template_kwargs)
        return self._run([_Prompt(None, self.engine.apply_chat_template(c, **rendering), cache_salt)
                          for c in conversations], params)

    def _tokenized(self, k: int, prompt: Any, cache_salt: str | None) -> _Prompt:
        """`prompts[k]` of `generate` as its text (None for token ids), its token ids and its salt (its own, for
        a dict that has one, else the call's `cache_salt`)."""
        if isinstance(prompt, dict):
            return self._prompt_of_dict(k, prompt, cache_salt)
        if isinstance(prompt, str):
            return _Prompt(prompt, self.engine.tokenize(prompt), cache_salt)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            return _Prompt(None, _token_ids(k, prompt), cache_salt)
        raise ValueError(f"prompts[{k}] must be a string, a list of integer token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids' (vLLM's TextPrompt, TokensPrompt), got {_shown(prompt)}")

    def _prompt_of_dict(self, k: int, prompt: dict, cache_salt: str | None) -> _Prompt:
        """A TextPrompt (`prompt`) or TokensPrompt (`prompt_token_ids`, with the text they stand for in `prompt`
        if the caller has it), as vLLM defines them; either may carry its own `cache_salt`. Their multi-modal
        keys are taken only when empty (None): kvstrata runs text models."""
        unknown = [key for key in prompt if key not in _PROMPT_KEYS
                   and not (key in _EMPTY_ONLY_KEYS and prompt[key] is None)]
        if unknown:
            raise ValueError(f"prompts[{k}]: {unknown[0]!r} is not supported (a dict prompt holds 'prompt' or "
                             f"'prompt_token_ids', and 'cache_salt')")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompts[{k}]['prompt'] must be a string, got {_shown(text)}")
        if ids is None and text is None:
            raise ValueError(f"prompts[{k}] must hold 'prompt' (text) or 'prompt_token_ids' (token ids)")
        if ids is not None and (isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence)):
            raise ValueError(f"prompts[{k}]['prompt_token_ids'] must be a list of token ids, got {_shown(ids)}")
        own_salt = prompt.get("cache_salt")
        if own_salt is not None:
            check_cache_salt(own_salt, f"prompts[{k}]['cache_salt']")
            if cache_salt is not None and own_salt != cache_salt:  # two tenants' salts for one prompt: a mistake
                raise ValueError(f"prompts[{k}]['cache_salt'] differs from the call's cache_salt: give one")
        salt = own_salt if own_salt is not None else cache_salt
        if ids is not None:
            return _Prompt(text, _token_ids(k, ids), salt)
        return _Prompt(text, self.engine.tokenize(text), salt)

    def _run(self, prompts: list[_Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        """One engine request per sequence (`n` per prompt), all validated before any is added, so a
        bad prompt leaves nothing half-scheduled; one output per prompt, in order."""
        requests = [(prompt, p.for_choice(i)) for prompt, p in zip(prompts, params) for i in range(p.n)]
        requests = [(prompt, self.engine.validate_request(prompt.token_ids, p), p) for prompt, p in requests]
        arrival = time.perf_counter()
        ids = []
        for prompt, token_ids, p in requests:
            rid = f"gen-{next(self._ids)}"
            self.engine.add_validated_request(rid, token_ids, p, cache_salt=prompt.cache_salt, prompt=prompt.text,
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
        self._check_open()
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or None, got {_shown(prompt)}")
        check_cache_salt(cache_salt)
        check_bool("pin", pin)
        document = render_document(self.tokenizer, messages=messages, prompt=prompt)
        return self.engine.cache_document(document, cache_salt, pin)

    def list_documents(self) -> list[Document]:
        """Documents cached with `cache_document` or `cache.preload` (and pinned ones from before a restart)."""
        self._check_open()
        return self.engine.documents.list()

    def unpin_document(self, document_id: str) -> Document:
        """Forget a document: its blocks become ordinary cached blocks, evictable again. KeyError if unknown."""
        self._check_open()
        return self.engine.documents.unpin(document_id)

    def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Forget every block cached on the device, if no request is running; the lower tiers keep
        theirs (`offload: on_evict` writes them down first, as eviction would). `reset_external=True`
        forgets everything cached instead: every tier (a shared disk or remote tier for everyone
        sharing it), the documents and their pins. Falsy if requests run or a tier could not be cleared."""
        self._check_open()
        check_bool("reset_external", reset_external)
        return self.engine.reset_prefix_cache(reset_external)

    def stats(self) -> dict:
        """Per-tier blocks, bytes, hits, misses, evictions; prefix-cache query and hit tokens; moves.
        After `close()`, the figures as of the close (what writing down did)."""
        return self.engine.stats()

    def close(self) -> None:
        """Flush pending write-downs to disk (so the next process finds them) and release the tiers.
        Afterwards only `stats()` and the tokenizer answer: every other call raises RuntimeError. Closing
        again does nothing."""
        self._closed = True
        try:
            self.engine.close()
        finally:
            if self._publisher is not None:  # after the engine's close, whose write-down it reports
                self._publisher.close()

    def _check_open(self) -> None:
        # a closed engine's tiers are released: a call would fail deep in one of them, or quietly
        # succeed only while its prompt happens to need no lower tier
        if self._closed:
            raise RuntimeError("this LLM is closed: create a new one")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# vLLM's dict prompts: TextPrompt and TokensPrompt (vllm/inputs). Their multi-modal keys ask for what kvstrata
# does not do: refused, unless empty.
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_EMPTY_ONLY_KEYS = ("multi_modal_data", "mm_processor_kwargs")


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a call, ready for the engine: its text (None for token ids given alone), ids and salt."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None


def _prompt_list(prompts: Any) -> list:
    """`generate`'s prompts as a list: one prompt (text, token ids, a dict) may come alone, as in vLLM."""
    alone = isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                 and isinstance(prompts[0], int))
    if alone:
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', "
                         "or a non-empty list of them")
    return list(prompts)


def _token_ids(k: int, prompt: Sequence) -> list[int]:
    """`prompts[k]` as a list of token ids. A bool is an int to Python, but True as token id 1 is a mistake."""
    for j, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompts[{k}] must be a string or a list of integer token ids: item {j} is {t!r}")
    return list(prompt)


def _conversations(messages: Any) -> list:
    """`chat`'s messages as a list of conversations: one conversation (a list of message dicts) may come alone."""
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError("messages must be a conversation (a non-empty list of {role, content} dicts) or a "
                         f"non-empty list of them, got {_shown(messages)}")
    return [messages] if isinstance(messages[0], dict) else list(messages)


def _call_params(num_prompts: int, sampling_params: Any, cache_salt: Any, use_tqdm: Any,
                 lora_request: Any) -> list[SamplingParams]:
    """The arguments `generate` and `chat` share beside their prompts, checked before any prompt is rendered;
    returns the SamplingParams of each prompt."""
    check_cache_salt(cache_salt)
    if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
        raise TypeError(f"use_tqdm must be True, False or a callable (vLLM's progress bar), got {_shown(use_tqdm)}")
    if lora_request is not None:
        raise ValueError("lora_request: kvstrata does not support LoRA adapters (give None)")
    return _params_per_prompt(sampling_params, num_prompts)


def _params_per_prompt(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt, "
                        f"got {_shown(sampling_params)}")
    for k, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{k}] must be a SamplingParams, got {_shown(p)}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"{len(sampling_params)} sampling params for {num_prompts} prompts")
    return list(sampling_params)


def check_cache_salt(cache_salt: Any, name: str = "cache_salt") -> None:
    """A salt is hashed into every block key as it is: a string, so that the same salt means the same
    cache entries from Python and over HTTP (whose schema takes only a string)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise TypeError(f"{name} must be a string or None, got {_shown(cache_salt)}")
    check_text(cache_salt, name)


def check_bool(name: str, value: Any) -> None:
    """An option that is on or off: a truthy "no" or 1 must not switch it on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_shown(value)}")


def _check_template_kwargs(kwargs: Any) -> None:
    """The template's extra variables: names (strings) to values, passed on as keyword arguments."""
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(name, str) for name in kwargs)):
        raise TypeError(f"chat_template_kwargs must be a dict of variable names (strings) to values, or None, "
                        f"got {_shown(kwargs)}")


def _shown(value: Any) -> str:
    """A bad argument in an error message, on one line: its value when that is short and says more than its
    type (`5`, `'x'`, `[None]`), else its type (`object`, not `<object object at 0x7f...>`)."""
    text = repr(value)
    plain = type(value).__repr__ is object.__repr__
    return type(value).__name__ if plain or len(text) > 40 or "\n" in text else text
