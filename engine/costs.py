"""Measured costs: how long the engine takes to compute tokens and each lower tier to deliver blocks.

Two small linear models, each fitted to recent measurements by least squares:

- `StepCost`, one engine step: `fixed + per_token_s * tokens + per_pair_s * pairs + per_read_s * reads`,
  where the fixed cost is one of two, `replayed_overhead_s` for a step replayed as a recorded CUDA graph and
  `overhead_s` for a step whose kernels are launched one by one from Python (eager), and where `pairs` counts
  the (query, key) pairs the step's attention scores and `reads` the keys it reads, summed over its sequences:
  a sequence computing `n` new tokens after `context` computed ones scores `n * context + n * (n + 1) / 2`
  pairs and reads `context + n` keys (once per step, whatever `n`: the paged K/V gathered on a CPU, or read
  from device memory). Reads are what a decode row
  mostly costs (one new token over a long context); without them the fit took a step's decodes for
  fixed overhead, and the step cap's overhead floor grew with every answer being decoded. The two fixed
  costs are apart because on a GPU they differ by an order of magnitude (a replayed question against an
  eager step of any size): with one, fitted mostly from replayed decodes and questions, a long eager
  step was priced at a third of what it took, and the load policy recomputed that many tokens of a disk
  hit beside a load that was faster. It prices waiting work and caps steps (the
  scheduler) and prices recomputing a prefix (the load policy).
- `ReadCost`, one load from a lower tier to the device: `latency_s + per_block_s * blocks`, seeded
  by a probe at start-up and refined by every promotion.

Each model keeps its recent measurements in a few windows (small and large steps or loads apart, so a
long run of decodes cannot push out what the prefills taught it), the newer weighing more, and is
refitted when asked after a new measurement. A weak prior (the values it was built with) holds each coefficient until measurements
say otherwise, and keeps a coefficient that recent measurements cannot tell apart from another where it was.
"""
from __future__ import annotations

import math
from collections import deque

MIN_STEP_TOKENS = 32     # the step cap never goes below this many tokens ...
MAX_OVERHEAD_SHARE = 0.1  # ... nor so low that the fixed cost of a step exceeds this share of it
WINDOW = 32              # measurements kept per window
DECAY = 0.8              # each older measurement in a window weighs this much less: speeds that change are followed
PRIOR_WEIGHT = 1e-6      # the prior counts as this many measurements at each coefficient's typical scale


def attention_pairs(num_new_tokens: int, context: int) -> int:
    """(query, key) pairs scored when `num_new_tokens` tokens follow `context` computed ones, causally."""
    return num_new_tokens * context + num_new_tokens * (num_new_tokens + 1) // 2


def kv_reads(num_new_tokens: int, context: int) -> int:
    """Keys a step reads for one sequence computing `num_new_tokens` after `context` computed ones."""
    return context + num_new_tokens if num_new_tokens > 0 else 0


class LinearFit:
    """`y = sum(coef[j] * x[j])`, least squares over the windows' measurements, ridge towards a prior.

    `scales[j]` is a typical size of feature `j`: the prior on `coef[j]` weighs as much as
    `PRIOR_WEIGHT` measurements whose feature `j` has that size. Coefficients are kept non-negative
    (a cost never falls as work grows; a negative fit is noise).
    """

    def __init__(self, prior: tuple[float, ...], scales: tuple[float, ...], num_windows: int = 2):
        assert len(prior) == len(scales)
        self.prior = tuple(float(p) for p in prior)
        self.scales = scales
        self.windows: list[deque] = [deque(maxlen=WINDOW) for _ in range(num_windows)]
        # Each window's weighted normal-equation sums, X^T W X and X^T W y, kept up to date as measurements
        # come and go: the engine refits after every step, and summing the windows again each time was a
        # fifth of a decode step's host work.
        n = len(prior)
        self._xtx = [[[0.0] * n for _ in range(n)] for _ in range(num_windows)]
        self._xty = [[0.0] * n for _ in range(num_windows)]
        self._coef: tuple[float, ...] | None = self.prior

    def observe(self, x: tuple[float, ...], y: float, window: int = 0) -> None:
        x, y = tuple(float(v) for v in x), float(y)
        measurements, xtx, xty = self.windows[window], self._xtx[window], self._xty[window]
        # every measurement already in the window ages by one: its weight falls by DECAY; the one the
        # new measurement pushes out (weighing DECAY ** WINDOW once aged) leaves the sums
        gone_x, gone_y = measurements[0] if len(measurements) == WINDOW else ((0.0,) * len(x), 0.0)
        gone_weight = DECAY ** WINDOW
        for i, (xi, gi) in enumerate(zip(x, gone_x)):
            xty[i] = DECAY * xty[i] + xi * y - gone_weight * gi * gone_y
            row = xtx[i]
            for j, (xj, gj) in enumerate(zip(x, gone_x)):
                row[j] = DECAY * row[j] + xi * xj - gone_weight * gi * gj
        measurements.append((x, y))
        self._coef = None

    @property
    def coef(self) -> tuple[float, ...]:
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    @property
    def num_observations(self) -> int:
        return sum(len(w) for w in self.windows)

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self.coef, x))

    def _solve(self) -> tuple[float, ...]:
        n = len(self.prior)
        # normal equations (X^T W X + L) c = X^T W y + L prior, with L diagonal and W the measurements' weights
        # (within a window, the newest weighs 1 and each older one DECAY times less)
        a = [[sum(xtx[i][j] for xtx in self._xtx) for j in range(n)] for i in range(n)]
        b = [sum(xty[i] for xty in self._xty) for i in range(n)]
        for j in range(n):
            ridge = PRIOR_WEIGHT * self.scales[j] ** 2
            a[j][j] += ridge
            b[j] += ridge * self.prior[j]
        # Non-negative: a coefficient the fit wants below 0 is held at 0 and the others are fitted again
        # without it. (Clamping it after the solve would keep the others' values, which made up for the
        # negative one, and overprice work.)
        free = list(range(n))
        while True:
            solved = _solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            if all(c >= 0 for c in solved):
                break
            free = [j for j, c in zip(free, solved) if c > 0]
        coef = [0.0] * n
        for j, c in zip(free, solved):
            coef[j] = c
        return tuple(coef)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are 2x2 to 5x5, positive definite)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepCost:
    """The engine's measured step time (see the module doc). Before any measurement the per-token
    cost is a CPU-sized guess and attention is free; the first steps replace both.

    `replay_tokens`: steps of one sequence with at most this many new tokens are replayed as recorded CUDA
    graphs (0: none is; set by the engine from its model runner), so they are priced with the replayed fixed
    cost."""

    SMALL_STEP_TOKENS = 8  # steps of at most this many tokens (decodes) go in their own window

    def __init__(self, per_token_s: float = 2e-3, overhead_s: float = 0.0, per_pair_s: float = 0.0,
                 per_read_s: float = 0.0, replayed_overhead_s: float = 0.0, replay_tokens: int = 0):
        # features: (eager, replayed, tokens, pairs, reads), the first two 1 or 0 and never both
        self.fit = LinearFit(prior=(overhead_s, replayed_overhead_s, per_token_s, per_pair_s, per_read_s),
                             scales=(1.0, 1.0, 512.0, 512.0 * 1024, 2048.0))
        self.replay_tokens = replay_tokens

    @property
    def overhead_s(self) -> float:
        """The fixed cost of an eager step (every step where no graph is replayed: all of them on a CPU)."""
        return self.fit.coef[0]

    @property
    def replayed_overhead_s(self) -> float:
        """The fixed cost of a step replayed as a recorded CUDA graph."""
        return self.fit.coef[1]

    @property
    def per_token_s(self) -> float:
        return self.fit.coef[2]

    @property
    def per_pair_s(self) -> float:
        return self.fit.coef[3]

    @property
    def per_read_s(self) -> float:
        return self.fit.coef[4]

    def observe(self, num_tokens: int, seconds: float, num_pairs: int = 0, num_reads: int = 0,
                replayed: bool = False) -> None:
        """A step computed `num_tokens` tokens, scoring `num_pairs` attention pairs and reading
        `num_reads` keys, in `seconds`; `replayed`: as a recorded CUDA graph."""
        if num_tokens <= 0:
            return
        self.fit.observe((float(not replayed), float(replayed), num_tokens, num_pairs, num_reads), seconds,
                         window=int(num_tokens > self.SMALL_STEP_TOKENS))

    def overhead_of(self, num_new_tokens: int) -> float:
        """The fixed cost of a step of one sequence computing `num_new_tokens`: replayed or eager."""
        return self.replayed_overhead_s if 0 < num_new_tokens <= self.replay_tokens else self.overhead_s

    def step_s(self, num_new_tokens: int, context: int) -> float:
        """Seconds of a step of its own computing `num_new_tokens` after `context` computed ones, its fixed
        cost included (replayed or eager, by its size)."""
        if num_new_tokens <= 0:
            return 0.0
        return self.overhead_of(num_new_tokens) + self.prefill_s(num_new_tokens, context)

    def prefill_s(self, num_new_tokens: int, context: int) -> float:
        """Seconds of compute for `num_new_tokens` after `context` computed ones in one step, without
        the step's overhead (in several steps, each would read the context again)."""
        if num_new_tokens <= 0:
            return 0.0
        return (self.per_token_s * num_new_tokens + self.per_pair_s * attention_pairs(num_new_tokens, context)
                + self.per_read_s * kv_reads(num_new_tokens, context))

    def tokens_within(self, seconds: float, context: int = 0) -> int:
        """The tokens a step may take to last `seconds` when they follow `context` computed ones (their
        attention grows with it), within the floors of the step cap. The overhead floor is in time, so
        it is priced at the context too: after a long context fewer tokens make the step long enough."""
        overhead_floor = self.tokens_for(self.overhead_s * (1 - MAX_OVERHEAD_SHARE) / MAX_OVERHEAD_SHARE, context)
        return max(MIN_STEP_TOKENS, overhead_floor, self.tokens_for(seconds - self.overhead_s, context))

    def tokens_for(self, compute_s: float, context: int = 0) -> int:
        """The tokens whose compute (a step's fixed cost aside) takes `compute_s` seconds when they
        follow `context` computed ones."""
        # per_token * n + per_pair * (n * context + n * (n + 1) / 2) + per_read * (context + n) = compute_s,
        # solved for n
        a = self.per_pair_s / 2
        b = max(self.per_token_s, 1e-9) + self.per_pair_s * (context + 0.5) + self.per_read_s
        c = max(compute_s - self.per_read_s * context, 0.0)
        return int(c / b if a <= 0 else (math.sqrt(b * b + 4 * a * c) - b) / (2 * a))


class ReadCost:
    """One lower tier's measured load time: `latency_s + per_block_s * blocks` (see the module doc).
    Until measured, loads are free: a tier nobody has timed is always loaded from."""

    SMALL_LOAD_BLOCKS = 2  # loads of at most this many blocks go in their own window

    def __init__(self, block_nbytes: int, latency_s: float = 0.0, per_block_s: float = 0.0):
        self.block_nbytes = block_nbytes
        self.fit = LinearFit(prior=(latency_s, per_block_s), scales=(1.0, 16.0))

    @property
    def latency_s(self) -> float:
        return self.fit.coef[0]

    @property
    def per_block_s(self) -> float:
        return self.fit.coef[1]

    @property
    def bytes_per_s(self) -> float:
        """Delivered read bandwidth (0 until measured)."""
        return self.block_nbytes / self.per_block_s if self.per_block_s > 0 else 0.0

    def observe(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self.fit.observe((1.0, num_blocks), seconds, window=int(num_blocks > self.SMALL_LOAD_BLOCKS))

    def load_s(self, num_blocks: int) -> float:
        return self.latency_s + self.per_block_s * num_blocks if num_blocks > 0 else 0.0
