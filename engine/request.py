"""One generation request as the scheduler and the KV manager see it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvstrata.engine.receipt import CacheReceipt, HitAccount, PhaseTimes
from kvstrata.engine.sampling import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Its prefix was found below the device and is being copied up (vLLM: WAITING_FOR_REMOTE_KVS);
    # still in the waiting queue, it is admitted once the copy has landed.
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"      # EOS or a stop string
    FINISHED_LENGTH = "length"     # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    # An internal error while handling it (its admission, its blocks, the step it was in): it alone ends,
    # its blocks freed; `Request.error` says what failed.
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class RequestFailedError(RuntimeError):
    """A request ended by an internal error of the engine's (`RequestStatus.FINISHED_ERROR`); the engine
    goes on with the others. The message is one line; the traceback is in the engine's log."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    prompt: str | None = None
    # Compute and cache the prompt's blocks, generate nothing (a document being cached): the request
    # finishes, with "length", once its prompt is computed.
    prefill_only: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    # One entry per output token when the request asks for logprobs (sampling_params.logprobs), and the sum
    # of their log-probabilities (kept as they come: an output snapshot at every token must not sum them all).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Entry k: prompt token k+1 given the tokens before it, when the request asks for prompt logprobs ...
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # ... and, once all are there, those entries with as many alternatives as it asked for (engine/llm.py):
    # built once, not at every output snapshot.
    shown_prompt_logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # what failed, one line, when it ended with FINISHED_ERROR
    # Tokens whose K/V are in the device cache (computed or served from a tier).
    num_computed_tokens: int = 0
    # Chain hashes of the request's full blocks (prompt + output so far), extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # What the cache served it, counted once across admissions (engine/receipt.py).
    hits: HitAccount = field(default_factory=HitAccount)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Where the time to first token goes (engine/receipt.py).
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_logprobs(self, entry: TokenLogprobs) -> None:
        """The entry of the output token just sampled."""
        self.output_logprobs.append(entry)
        self.cumulative_logprob += entry.logprob

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `[start, stop)` of prompt and output together, without copying the whole sequence
        (which a long document would at every step)."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):stop - len(prompt)]
        return prompt[start:] + self.output_token_ids[:stop - len(prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cached_tokens_by_tier(self) -> dict[str, int] | None:
        """Prompt tokens served from the cache, per tier (measured); None until the request is admitted."""
        return self.hits.cached_tokens_by_tier

    @cached_tokens_by_tier.setter
    def cached_tokens_by_tier(self, by_tier: dict[str, int] | None) -> None:
        self.hits.cached_tokens_by_tier = by_tier

    @property
    def recomputed_tokens_by_tier(self) -> dict[str, int] | None:
        """Prompt tokens found in each tier but recomputed by the load policy's choice."""
        return self.hits.recomputed_tokens_by_tier

    @property
    def prefill_saved_s_estimate(self) -> float:
        """The prefill time its cached tokens saved at the measured prefill cost (an estimate)."""
        return self.hits.prefill_saved_s_estimate

    @property
    def num_cached_tokens(self) -> int:
        return sum((self.cached_tokens_by_tier or {}).values())

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for its prompt's log-probabilities and lacks some: every prompt token must be
        computed (a cached token has no logits), so it takes no cached prefix until it has them."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def enter_phase(self, phase: str, now: float | None = None) -> None:
        """The request moves to `phase` (queue, lookup, load, prefill) now; no-op after its first token."""
        self.phases.enter(phase, time.perf_counter() if now is None else now, self.arrival_time)

    def set_first_token_time(self, now: float) -> None:
        self.first_token_time = now
        self.phases.finish(now, self.arrival_time)

    @property
    def receipt(self) -> CacheReceipt | None:
        """The measured receipt, once the first token is out."""
        if self.first_token_time is None:
            return None
        return CacheReceipt.measured(self.ttft_s, self.phases, self.cached_tokens_by_tier or {},
                                     self.recomputed_tokens_by_tier or {}, self.prefill_saved_s_estimate)
