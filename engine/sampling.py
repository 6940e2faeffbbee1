"""Sampling parameters and the sampler: logits of a batch in, one token id per row out (and, for
the rows that ask, the log-probabilities of what was sampled and of the most likely tokens).

Order (vLLM's): `adjust_logits` first (min_tokens keeps the stop tokens out, then logit_bias, then
the repetition, frequency and presence penalties), then greedy argmax, or temperature, min_p, top-k
and top-p and a draw. Log-probabilities are taken from the logits before any of it.

Stop strings are matched by the detokenizing layer, not here: the sampler sees only logits.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from kvstrata.engine.structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy (as vLLM): dividing logits by 1e-38 overflows to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a request may ask log-probabilities for, per generated token (vLLM's default).
MAX_LOGPROBS = 20
# The most sequences a request may sample from one prompt (`n`; OpenAI's limit): each is a request of its own.
MAX_N = 128
_SEED_RANGE = (-2**63, 2**63)  # a 64-bit signed integer, as vLLM and most clients take a seed to be


@dataclass
class SamplingParams:
    """What a request asks of generation (vLLM's names and defaults where they exist).

    temperature 0 (or below GREEDY_TEMPERATURE) means greedy. top_k -1 or 0 means off. `min_p` drops
    the tokens less likely than that fraction of the most likely one (after temperature). `seed` makes
    a request reproducible on its own, whatever else shares its batch. `stop` is normalised to a list;
    `stop_token_ids` end generation too (the token is not part of the text, as an end of sequence is
    not); `min_tokens` tokens are generated before either, or the end of sequence, may end it.
    Penalties (OpenAI's and vLLM's meanings): `presence_penalty` is subtracted from the logit of every
    token generated so far, `frequency_penalty` once per time it was generated; `repetition_penalty`
    divides the positive logits (and multiplies the negative ones) of every token in the prompt or
    generated so far. `logit_bias` adds a value from -100 to 100 to a token id's logit.
    `logprobs`: None, or how many of the most likely alternatives to report with each generated
    token's log-probability (0: the token's own only). `prompt_logprobs` (vLLM's): the same for each
    prompt token after the first; a cached token has no logits, so such a request computes its whole
    prompt (its blocks are still cached for others). Log-probabilities are those of the model's
    distribution before any of the above (vLLM's default, "raw" log-probabilities).
    `n` (vLLM's): how many sequences to sample from the prompt. `LLM.generate` and the server run
    one engine request per sequence, sequence i with `for_choice(i)`; the engine itself takes n=1.
    vLLM's text options: `include_stop_str_in_output` keeps the stop string (or the stop token's
    text) that ended the answer at its end; `skip_special_tokens` (default True) leaves special
    tokens' text out of the answer. `structured_outputs` (vLLM's): the answer is held to a JSON
    schema, or to any JSON object, and ends when its JSON is complete (engine/structured_outputs.py).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer from 1 to {MAX_N}, got {self.n!r}")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} or None, got {value!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0
                                                                         for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_real(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map token ids (integers >= 0) to numbers from -100 to 100, "
                             f"got {self.logit_bias!r}")
        self.stop = _normalise_stop(self.stop)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")

    def for_choice(self, choice: int) -> SamplingParams:
        """The parameters of the prompt's `choice`-th sequence (n=1): with a seed, seed + choice
        (vLLM's rule, wrapping within 64 bits), so that seeded sequences differ from one another
        and the same request gives the same sequences again."""
        if self.n == 1 and choice == 0:
            return self  # one sequence: the request's own parameters, as given
        seed = self.seed if self.seed is None else (self.seed + choice - _SEED_RANGE[0]) % 2**64 + _SEED_RANGE[0]
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def token_ids_named(self) -> list[int]:
        """The token ids the request names (`stop_token_ids`, `logit_bias`): each must be in the vocabulary."""
        return [*self.stop_token_ids, *self.logit_bias]

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _normalise_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


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
    temperature, then min_p, top-k and top-p, then one draw from the row's own generator.

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
    scaled = _filter_min_p(logits[rows] / temperatures[:, None], params)
    probs = _filter_top_k_top_p(scaled, params).softmax(dim=-1)
    token_ids[rows] = _draw(probs, [generators[i] for i in random_rows])
    return token_ids


def adjust_logits(logits: torch.Tensor, params_list: Sequence[SamplingParams],
                  prompt_ids: Sequence[Sequence[int] | torch.Tensor], output_ids: Sequence[Sequence[int]],
                  eos_token_ids: Collection[int]) -> torch.Tensor:
    """The logits `sample` draws from: each row's min_tokens, logit_bias and penalties applied (see
    the module doc), given the row's prompt (token ids, or a tensor of them, on the logits' device
    for speed) and the tokens it has generated so far. Rows that ask for none of them keep their
    logits; `logits` itself is left as it is (log-probabilities come from it)."""
    rows = [i for i, p in enumerate(params_list)
            if len(output_ids[i]) < p.min_tokens or p.logit_bias or p.penalised]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        params, row = params_list[i], logits[i]
        if len(output_ids[i]) < params.min_tokens:  # nothing may end the answer yet
            stops = [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
            row[_ids(stops, row.device)] = -math.inf
        if params.logit_bias:
            row[_ids(params.logit_bias, row.device)] += torch.tensor(list(params.logit_bias.values()),
                                                                     dtype=row.dtype, device=row.device)
        if params.penalised:
            _penalise(row, params, prompt_ids[i], output_ids[i])
    return logits


def _ids(token_ids, device) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to(device)
    return torch.tensor(list(token_ids), dtype=torch.int64, device=device)


def _penalise(row: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] | torch.Tensor,
              output_ids: Sequence[int]) -> None:
    """The repetition penalty on every token of the prompt and the output so far, then the frequency
    and presence penalties on those of the output (in place, on one row of logits)."""
    output = _ids(output_ids, row.device)
    # index_add, not bincount: bincount on a GPU reads its input's maximum back (a sync per row)
    counts = torch.zeros_like(row).index_add_(0, output, torch.ones_like(output, dtype=row.dtype))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[_ids(prompt_ids, row.device)] = True
        penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        # a penalty near 0 (valid: it favours repeating) overflows the division to inf, and softmax to NaN: held
        # where no temperature's division overflows, the tokens it favours stay the likeliest and the draw sound
        bound = torch.finfo(row.dtype).max * GREEDY_TEMPERATURE
        row.copy_(torch.where(seen, penalised.clamp_(-bound, bound), row))
    row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _filter_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logits of the tokens whose probability is below each row's min_p times that of
    its most likely token (the most likely token always stays)."""
    if all(p.min_p <= 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=logits.device)
    too_unlikely = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(too_unlikely, -math.inf)


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


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs [R, V]` by the exponential race (argmax of p / Exp(1)), as vLLM
    does: one pass, no cumulative sum, and tokens with probability 0 can never win. A row with a
    generator draws its noise from it alone; the rows without one share a single draw from torch's
    global stream (one kernel for the batch, where a draw per row launched several per row)."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability (a generated token's, or a prompt token's), and the most likely
    tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, log-probability), most likely first; `logprobs` long
    rank: int  # the token's place in the vocabulary by log-probability: 1 if none is likelier (vLLM's rank)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """For each row of `logits [B, V]` with a `num_top[row]`: the log-probability of its token
    `token_ids[row]` (sampled, or the prompt's next), its rank and its `num_top[row]` most likely
    tokens; None for the rows whose `num_top` is None. Computed from the raw logits in float32, in one
    batched pass over the rows that ask. A rank counts the tokens at least as likely, the token
    included (as vLLM counts it): a tie does not make a token look likelier than it is."""
    assert logits.dim() == 2 and len(num_top) == logits.shape[0] == token_ids.shape[0]
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[index].to(logits.device)[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen = chosen[:, 0].tolist()
    most = max(num_top[i] for i in rows)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = num_top[i]
        top = tuple((int(t), v) for t, v in zip(top_ids[j][:k], top_values[j][:k]))
        result[i] = TokenLogprobs(int(token_ids[i]), chosen[j], top, ranks[j])
    return result
