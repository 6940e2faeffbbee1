"""CUDA graphs for steps with few tokens (`model.cuda_graphs`): a decode step, a question after a cached document,
or a question beside decoding sequences replays the kernels recorded for its padded size instead of launching them
from Python, as vLLM and SGLang do.

Such a step does little arithmetic, so on a GPU its time is the host's: the Python of the forward pass and the
launch of each kernel (engine/decoder.py: about 11 a layer), and a replayed graph takes a fraction of the eager
step's time; a 16-token question costs the eager step as much as a decode. A graph replays every launch with one,
but needs the same shapes and arguments at each replay, so a step is padded to a size,
`(tokens, sequences)`:

- a decode step (one new token and its logits per sequence) to `(n, n)`, n the next of `CAPTURE_SIZES` (up to
  `max_num_seqs`) at or above its sequences;
- any other step of at most `max_tokens` tokens, wanting at most one logits row a sequence, to the next sequence
  size above its count plus one, and the next token size that holds its tokens and one for each padding sequence:
  the last padding sequence takes the tokens left over, so every padding token belongs to a sequence of its own;
- a padding sequence's tokens are id 0 at positions 0, 1, ... with a KV slot of -1 (the store skips them) and a
  context of their own count, read from whatever blocks its block-table row holds (any block id there is a valid
  one; its output rows are dropped, and attention never mixes rows of two sequences);
- the block table to the model's longest sequence (`max_model_len` keys), which also fixes the attention's
  split-KV choice (kernels/prefix_prefill.py chooses it from the table's width and the step's shape, on the host,
  never from the lengths on the device);
- the logits rows to one a sequence, the padding ones reading the last token's row.

The step's own values are copied into the static inputs of its size before each replay. The engine records every
size at start (`record_all_sizes`: 40 with configs/gpu.yaml): a size recorded when a step first needs it is recorded
on that step's path (one eager run on a side stream, which also compiles the kernels, then the recording: tens of
milliseconds for SmolLM2). Steps larger than the largest sizes, or wanting more logits rows (prompt
log-probabilities), run eagerly. On a CPU (and in tests) the same padded step runs eagerly through the same code
(`record=False`): only recording and replay need CUDA.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from kvstrata.engine.decoder import StepInput

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # of sequences, and of tokens
MAX_GRAPH_TOKENS = 512  # the most tokens a recorded step holds: beyond, a step's arithmetic outweighs its launches


@dataclass(frozen=True)
class Size:
    """A recorded step's shape: its tokens and its sequences (and as many logits rows)."""

    tokens: int
    seqs: int


def static_step(size: Size, max_blocks: int, device: torch.device) -> StepInput:
    """A padded step's inputs on the device, inert (every row padding, a token a sequence), for a recorded graph to
    read: their addresses never change, only their values."""
    def zeros(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype, device=device)

    def ints(values: list[int], dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    positions, seq_lens, ends = _padding(size, 0, 0)
    return StepInput(input_ids=zeros(size.tokens), positions=ints(positions),
                     slot_mapping=torch.full((size.tokens,), -1, device=device),
                     block_tables=zeros(size.seqs, max_blocks, dtype=torch.int32),
                     query_start_loc=ints([0] + ends, torch.int32), seq_lens=ints(seq_lens, torch.int32),
                     logits_indices=torch.full((size.seqs,), size.tokens - 1, device=device))


@dataclass
class _Recorded:
    inputs: StepInput  # on the device (`static_step`)
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no CUDA)
    logits: torch.Tensor | None         # the graph's output, overwritten by each replay


class StepGraphs:
    """Runs steps of few tokens padded to fixed sizes through `forward(step on the device) -> logits [seqs, vocab]`,
    recorded as CUDA graphs when `record` (the padding is the same either way)."""

    def __init__(self, forward: Callable[[StepInput], torch.Tensor], max_num_seqs: int, max_blocks: int,
                 device: torch.device, record: bool, max_tokens: int = MAX_GRAPH_TOKENS) -> None:
        self.forward = forward
        self.seq_sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.token_sizes = [s for s in CAPTURE_SIZES if s < max_tokens] + [max_tokens]
        self.max_blocks = max_blocks
        self.device = device
        self.record = record
        self._recorded: dict[Size, _Recorded] = {}
        self._pool = None  # one memory pool for every size's graph, as they never run at once

    @property
    def recorded_sizes(self) -> list[tuple[int, int]]:
        """(tokens, sequences) of each size recorded so far."""
        return sorted((s.tokens, s.seqs) for s in self._recorded)

    @property
    def replay_tokens(self) -> int:
        """The most new tokens a step of one sequence (a question, a short prompt) may hold and be replayed as a
        recorded graph: with its padding sequence, within the largest token size. 0 when nothing is recorded (no
        CUDA) or no step but a decode has a size (`max_num_seqs` 1)."""
        if not self.record or _next(self.seq_sizes, 2) is None:
            return 0
        return self.token_sizes[-1] - 1

    def size_of(self, step: StepInput) -> Size | None:
        """The size that holds `step`, or None when none does (it runs eagerly)."""
        num_tokens, num_seqs, num_logits = len(step.input_ids), len(step.seq_lens), len(step.logits_indices)
        if num_seqs == 0 or num_logits > num_seqs or len(step.block_tables[0]) > self.max_blocks:
            return None
        if num_tokens == num_seqs == num_logits:  # a decode step: padding sequences of a token each
            return self._decode_size(_next(self.seq_sizes, num_seqs))
        seqs = _next(self.seq_sizes, num_seqs + 1)  # at least one padding sequence, to hold the padding tokens
        tokens = None if seqs is None else _next(self.token_sizes, num_tokens + seqs - num_seqs)
        return None if tokens is None else Size(tokens, seqs)

    def _decode_size(self, seqs: int | None) -> Size | None:
        """The size of a decode step padded to `seqs` sequences (a token each), if a recorded step may hold that many
        tokens."""
        return None if seqs is None or seqs > self.token_sizes[-1] else Size(seqs, seqs)

    def record_all_sizes(self) -> list[tuple[int, int]]:
        """Record ahead every size a step may be padded to: each decode batch's, and each (tokens, sequences) of a
        step with a padding sequence (more tokens than sequences: a question, a short prompt, either beside decoding
        sequences), so that no step waits for a recording. Recorded when first needed instead, a question beside one
        decoding sequence made that sequence's next token wait many times its usual gap. Returns the (tokens,
        sequences) sizes recorded."""
        sizes = [size for size in map(self._decode_size, self.seq_sizes) if size is not None]
        sizes += [Size(tokens, seqs) for seqs in self.seq_sizes if seqs >= 2 for tokens in self.token_sizes
                  if tokens > seqs]
        for size in sizes:
            if size not in self._recorded:
                self._record(size)
        return [(s.tokens, s.seqs) for s in sizes]

    def fits(self, step: StepInput) -> bool:
        return self.size_of(step) is not None

    def run(self, step: StepInput, size: Size) -> torch.Tensor:
        """The step's logits `[len(logits_indices), vocab]` (float32; a copy, which the next replay leaves alone),
        padded to `size` (`size_of(step)`)."""
        recorded = self._recorded.get(size) or self._record(size)
        self._fill(recorded.inputs, step, size)
        num_logits = len(step.logits_indices)
        if recorded.graph is None:
            return self.forward(recorded.inputs)[:num_logits]
        recorded.graph.replay()
        return recorded.logits[:num_logits].clone()

    def _fill(self, inputs: StepInput, step: StepInput, size: Size) -> None:
        """The step's values into the first rows, and the padding rows made inert again: a padding token an
        earlier step left there would otherwise store K/V into a slot that may belong to another sequence now."""
        def copy(dest: torch.Tensor, data, dtype: torch.dtype) -> None:
            dest.copy_(torch.as_tensor(data, dtype=dtype), non_blocking=True)

        num_tokens, num_seqs, num_logits = len(step.input_ids), len(step.seq_lens), len(step.logits_indices)
        copy(inputs.input_ids[:num_tokens], step.input_ids, torch.int64)
        copy(inputs.positions[:num_tokens], step.positions, torch.int64)
        copy(inputs.slot_mapping[:num_tokens], step.slot_mapping, torch.int64)
        copy(inputs.seq_lens[:num_seqs], step.seq_lens, torch.int32)
        copy(inputs.query_start_loc[:num_seqs + 1], step.query_start_loc, torch.int32)
        copy(inputs.logits_indices[:num_logits], step.logits_indices, torch.int64)
        table = torch.as_tensor(step.block_tables, dtype=torch.int32)
        # columns past a sequence's length are never read: block ids an earlier step left there may stay
        copy(inputs.block_tables[:num_seqs, :table.shape[1]], table, torch.int32)
        inputs.slot_mapping[num_tokens:].fill_(-1)
        inputs.logits_indices[num_logits:].fill_(size.tokens - 1)
        if num_tokens < size.tokens:
            positions, seq_lens, ends = _padding(size, num_tokens, num_seqs)
            inputs.input_ids[num_tokens:].fill_(0)
            copy(inputs.positions[num_tokens:], positions, torch.int64)
            copy(inputs.seq_lens[num_seqs:], seq_lens, torch.int32)
            copy(inputs.query_start_loc[num_seqs + 1:], ends, torch.int32)

    def _record(self, size: Size) -> _Recorded:
        inputs = static_step(size, self.max_blocks, self.device)
        if not self.record:
            recorded = _Recorded(inputs, None, None)
        else:
            # one eager run first, on a side stream (torch's recipe): it compiles the kernels and settles the
            # allocator, so that recording sees only the launches of a step
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward(inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the transfer engine's threads may copy on their own streams meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self.forward(inputs)
            self._pool = graph.pool()
            recorded = _Recorded(inputs, graph, logits)
        self._recorded[size] = recorded
        return recorded


def _next(sizes: list[int], n: int) -> int | None:
    """The smallest of `sizes` (ascending) at or above n, or None."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


def _padding(size: Size, num_tokens: int, num_seqs: int) -> tuple[list[int], list[int], list[int]]:
    """The padding sequences of a step of `num_tokens` tokens in `num_seqs` sequences padded to `size`: their tokens'
    positions, their lengths and where each ends among the packed tokens. Each holds one token at position 0 but
    the last, which holds the tokens left over, at positions 0, 1, ..."""
    padding_seqs = size.seqs - num_seqs
    last = size.tokens - num_tokens - padding_seqs + 1
    return ([0] * (padding_seqs - 1) + list(range(last)), [1] * (padding_seqs - 1) + [last],
            list(range(num_tokens + 1, num_tokens + padding_seqs)) + [size.tokens])
