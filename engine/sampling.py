"""Sampling parameters and the sampler: logits of a batch in, one token id per row out (and, for
the rows that ask, the log-probabilities of what was sampled and of the most likely tokens).

Stop strings are matched by the detokenizing layer, not here: the sampler sees only logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Temperatures below this are greedy (as vLLM): dividing logits by 1e-38 overflows to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a request may ask log-probabilities for, per generated token (vLLM's default).
MAX_LOGPROBS = 20
_SEED_RANGE = (-2**63, 2**63)  # a 64-bit signed integer, as vLLM and most clients take a seed to be


@dataclass
class SamplingParams:
    """What a request asks of generation (vLLM's names and defaults where they exist).

    temperature 0 (or below GREEDY_TEMPERATURE) means greedy. top_k -1 or 0 means off. `seed` makes a
    request reproducible on its own, whatever else shares its batch. `stop` is normalised to a list.
    `logprobs`: None, or how many of the most likely alternatives to report with each generated
    token's log-probability (0: the token's own only). Log-probabilities are those of the model's
    distribution before temperature, top-k and top-p (vLLM's default, "raw" log-probabilities).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise ValueError(f"seed must be a 64-bit signed integer (from -2**63 to 2**63 - 1) or None, "
                             f"got {self.seed!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} or None, got {self.logprobs!r}")
        self.stop = _normalise_stop(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _normalise_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own random stream when it has a seed (kept for its whole life, so that its
    tokens differ from step to step); None = torch's global stream."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params_list: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of `logits [B, V]` (int64 `[B]`): argmax for greedy rows; for the others,
    temperature, then top-k, then top-p, then one draw from the row's own generator.

    Invariant: a row's draw depends only on its logits, its params and its generator, never on the
    other rows, so a seeded request gives the same tokens whatever it is batched with.
    """
    assert logits.dim() == 2 and len(params_list) == logits.shape[0] == len(generators)
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params_list) if not p.greedy]
    if not random_rows:
        return token_ids
    rows = torch.tensor(random_rows, device=logits.device)
    params = [params_list[i] for i in random_rows]
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
    probs = _filter_top_k_top_p(logits[rows] / temperatures[:, None], params).softmax(dim=-1)
    for probs_row, i in zip(probs, random_rows):
        token_ids[i] = _draw(probs_row, generators[i])
    return token_ids


def _filter_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logits outside each row's top k and outside its top-p nucleus (the smallest
    set of most likely tokens whose probability reaches top_p; the most likely token always stays)."""
    vocab_size = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= vocab_size for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)
    k = torch.tensor(top_k, device=logits.device)
    sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # rows with top_p == 1 get an unreachable threshold: rounding in the cumsum must not drop tokens
    p = torch.tensor([x if x < 1.0 else math.inf for x in top_p], device=logits.device)
    outside_nucleus = mass_before >= p[:, None]
    outside_nucleus[:, 0] = False
    sorted_logits.masked_fill_(outside_nucleus, -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(-1, sorted_ids, sorted_logits)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample from `probs [V]` by the exponential race (argmax of p / Exp(1)), as vLLM does: one
    pass, no cumulative sum, and tokens with probability 0 can never win."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, log-probability), most likely first; `logprobs` long


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     params_list: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    """For each row of `logits [B, V]` whose params ask for logprobs: the log-probability of its
    sampled token `token_ids[row]` and its `params.logprobs` most likely tokens; None for the others.
    Computed from the raw logits in float32, in one batched pass over the rows that ask."""
    assert logits.dim() == 2 and len(params_list) == logits.shape[0] == token_ids.shape[0]
    result: list[TokenLogprobs | None] = [None] * len(params_list)
    rows = [i for i, p in enumerate(params_list) if p.logprobs is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids[index].to(logits.device)[:, None])[:, 0].tolist()
    num_top = max(params_list[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params_list[i].logprobs
        top = tuple((int(t), v) for t, v in zip(top_ids[j][:k], top_values[j][:k]))
        result[i] = TokenLogprobs(int(token_ids[i]), sampled[j], top)
    return result
