"""CUDA graphs for decode steps (`model.cuda_graphs`): a step of one new token per sequence replays the kernels
recorded for its batch size instead of launching them from Python, as vLLM and SGLang do.

A decode step does little arithmetic, so on a GPU its time is the host's: the Python of the forward pass and the
launch of each kernel (engine/decoder.py: about 11 a layer). A graph replays them all with one launch. It needs
every launch to have the same shapes and the same arguments at each replay, so a decode step is padded to a
fixed size:

- the batch to the next of `CAPTURE_SIZES` (up to `max_num_seqs`): a padding sequence has one token, id 0, at
  position 0, a KV slot of -1 (the store skips it) and a context of one key in block 0 (any block: its output
  row is dropped);
- the block table to the model's longest sequence (`max_model_len` keys), which also fixes the attention's
  split-KV choice (kernels/prefix_prefill.py chooses it from the table's width and the batch's shape, on the
  host, never from the lengths on the device);
- `query_start_loc` and the logits rows are then 0, 1, 2, ...: constants of the size.

The step's own values are copied into the static inputs of its size before each replay. A size is recorded the
first time a step needs it (after one eager run on a side stream, which also compiles the kernels); prefill
chunks and steps larger than the largest size run eagerly. On a CPU (and in tests) the same padded step runs
eagerly through the same code (`record=False`): only recording and replay need CUDA.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from kvstrata.engine.decoder import StepInput

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def static_step(size: int, max_blocks: int, device: torch.device) -> StepInput:
    """A padded decode step's inputs on the device, inert (every row padding), for a recorded graph to read: their
    addresses never change, only their values."""
    def zeros(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return StepInput(input_ids=zeros(size), positions=zeros(size), slot_mapping=torch.full((size,), -1, device=device),
                     block_tables=zeros(size, max_blocks, dtype=torch.int32),
                     query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                     seq_lens=torch.ones(size, dtype=torch.int32, device=device),
                     logits_indices=torch.arange(size, device=device))


@dataclass
class _Recorded:
    inputs: StepInput  # on the device (`static_step`)
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no CUDA)
    logits: torch.Tensor | None         # the graph's output, overwritten by each replay


class DecodeGraphs:
    """Runs decode steps padded to fixed sizes through `forward(step on the device) -> logits [size, vocab]`,
    recorded as CUDA graphs when `record` (the padding is the same either way)."""

    def __init__(self, forward: Callable[[StepInput], torch.Tensor], max_num_seqs: int, max_blocks: int,
                 device: torch.device, record: bool) -> None:
        self.forward = forward
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.max_blocks = max_blocks
        self.device = device
        self.record = record
        self._recorded: dict[int, _Recorded] = {}
        self._pool = None  # one memory pool for every size's graph, as they never run at once

    @property
    def recorded_sizes(self) -> list[int]:
        return sorted(self._recorded)

    def fits(self, step: StepInput) -> bool:
        """A decode step (one new token and its logits per sequence) that a size holds."""
        num_seqs = len(step.seq_lens)
        return (0 < num_seqs <= self.sizes[-1] and len(step.input_ids) == num_seqs == len(step.logits_indices)
                and len(step.block_tables[0]) <= self.max_blocks)

    def run(self, step: StepInput) -> torch.Tensor:
        """The step's logits `[num_seqs, vocab]` (float32; a copy, which the next replay leaves alone)."""
        num_seqs = len(step.seq_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        recorded = self._recorded.get(size) or self._record(size)
        self._fill(recorded.inputs, step, num_seqs)
        if recorded.graph is None:
            return self.forward(recorded.inputs)[:num_seqs]
        recorded.graph.replay()
        return recorded.logits[:num_seqs].clone()

    def _fill(self, inputs: StepInput, step: StepInput, num_seqs: int) -> None:
        """The step's values into the first `num_seqs` rows, and the padding rows made inert again: a row an
        earlier, larger step used would otherwise store K/V into a slot that may belong to another sequence now."""
        def copy(dest: torch.Tensor, data, dtype: torch.dtype) -> None:
            dest.copy_(torch.as_tensor(data, dtype=dtype), non_blocking=True)

        copy(inputs.input_ids[:num_seqs], step.input_ids, torch.int64)
        copy(inputs.positions[:num_seqs], step.positions, torch.int64)
        copy(inputs.slot_mapping[:num_seqs], step.slot_mapping, torch.int64)
        copy(inputs.seq_lens[:num_seqs], step.seq_lens, torch.int32)
        table = torch.as_tensor(step.block_tables, dtype=torch.int32)
        # columns past a sequence's length are never read, nor are the padding rows' past their first: block ids
        # left there by an earlier step may stay (any block id is a valid one to read)
        copy(inputs.block_tables[:num_seqs, :table.shape[1]], table, torch.int32)
        inputs.slot_mapping[num_seqs:].fill_(-1)
        inputs.seq_lens[num_seqs:].fill_(1)

    def _record(self, size: int) -> _Recorded:
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
