"""Run one step of the model over the paged KV cache: packed new tokens in, logits of chosen rows out."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from kvstrata.engine.batch_invariant import BatchInvariantMode
from kvstrata.engine.cuda_graphs import StepGraphs
from kvstrata.engine.decoder import AttentionMetadata, Decoder, StepInput, store_transposed
from kvstrata.engine.model_loader import LoadedModel

__all__ = ["ModelRunner", "StepInput"]  # StepInput: defined with the forward pass, imported from here


class ModelRunner:
    """Owns nothing but references: the loaded model, the device KV cache and the kernel ops."""

    def __init__(self, loaded: LoadedModel, kv_cache: torch.Tensor, ops) -> None:
        assert kv_cache.device == loaded.device, f"KV cache is on {kv_cache.device}, model on {loaded.device}"
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.ops = ops
        self.device = loaded.device
        self._decoder = Decoder(loaded.model, ops)  # the transformer body: hidden states, no logits
        self._lm_head = loaded.model.get_output_embeddings()
        if self._decoder.transposed:
            store_transposed(self._lm_head.weight)
        self._graphs: StepGraphs | None = None  # see `enable_cuda_graphs`
        self.last_step_replayed = False  # the last `execute` replayed a recorded CUDA graph (its cost is another)

    def enable_cuda_graphs(self, max_num_seqs: int, max_blocks: int, record: bool) -> None:
        """Run steps of few tokens (decodes, questions) of up to `max_num_seqs` sequences, block tables up to
        `max_blocks` wide, padded to fixed sizes, recorded as CUDA graphs when `record` (engine/cuda_graphs.py)."""
        self._graphs = StepGraphs(self._forward, max_num_seqs, max_blocks, self.device, record)

    def record_all_graphs(self) -> list[tuple[int, int]]:
        """Record ahead every graph size a step may need (engine/cuda_graphs.py `record_all_sizes`)."""
        return [] if self._graphs is None else self._graphs.record_all_sizes()

    @property
    def recorded_graph_sizes(self) -> list[tuple[int, int]]:
        """The (tokens, sequences) sizes recorded (or, without CUDA, padded to) so far."""
        return [] if self._graphs is None else self._graphs.recorded_sizes

    @property
    def replay_tokens(self) -> int:
        """The most new tokens of a one-sequence step replayed as a recorded CUDA graph (0: none is)."""
        return 0 if self._graphs is None else self._graphs.replay_tokens

    def replays(self, step: StepInput) -> bool:
        """The step runs padded to a recorded size (a CUDA graph), not eagerly."""
        return self._graphs is not None and self._graphs.fits(step)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the step; returns float32 logits `[len(logits_indices), vocab_size]`."""
        size = None if self._graphs is None else self._graphs.size_of(step)  # once: it is on every step's path
        self.last_step_replayed = size is not None and self._graphs.record
        if size is not None:
            return self._graphs.run(step, size)
        return self._forward(StepInput(
            input_ids=self._tensor(step.input_ids, torch.int64),
            positions=self._tensor(step.positions, torch.int64),
            slot_mapping=self._tensor(step.slot_mapping, torch.int64),
            block_tables=self._tensor(step.block_tables, torch.int32),
            query_start_loc=self._tensor(step.query_start_loc, torch.int32),
            seq_lens=self._tensor(step.seq_lens, torch.int32),
            logits_indices=self._tensor(step.logits_indices, torch.int64)))

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The step, its fields tensors on the device, through the model: the logits of its chosen rows."""
        metadata = AttentionMetadata(slot_mapping=step.slot_mapping, block_tables=step.block_tables,
                                     query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
                                     kv_cache=self.kv_cache)
        with BatchInvariantMode(self.ops) if self.ops.intercept else nullcontext():
            hidden = self._decoder.forward(step.input_ids, step.positions, metadata)
            rows = hidden.index_select(0, step.logits_indices)
            # logits only for the sampled rows: a 2k-token prefill chunk would otherwise make 2k x 49k
            return self._decoder.linear(rows, self._lm_head.weight, self._lm_head.bias).float()

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(data, dtype=dtype).to(self.device, non_blocking=True)
