"""Batch-invariant attention: a query row's output bits depend only on its query and the keys it sees, never on
how its sequence was cut into steps or what it was batched with. Checked for the torch path and for the Triton
kernel under the interpreter (conftest sets TRITON_INTERPRET=1): one sequence computed whole, as a cached prefix
plus a suffix, token by token at its end (decode), and as a suffix batched beside other sequences whose lengths
change the launch (more key splits, other query tiles)."""
from __future__ import annotations

import functools

import pytest
import torch
from kernel_cases import TOLERANCE, make_paged_problem, naive_attention

from kvstrata.kernels.prefix_prefill import (INVARIANT_KEYS_PER_SPLIT, prefix_prefill, reference_prefix_prefill)

# Sequence 0 is the one under test: 700 positions, all of them queries, so any step of it can be cut out. Its keys
# span two Triton splits (512 keys each) and three torch key tiles. The others only share its launches: a longer
# context (three splits), a short prompt and a decode row.
LENGTH = 700
BATCH = [(0, LENGTH), (1100, 5), (0, 37), (90, 1)]

ATTENTION = {
    "torch": functools.partial(reference_prefix_prefill, batch_invariant=True),
    "triton": functools.partial(prefix_prefill, batch_invariant=True),
}


@functools.cache
def problem(dtype: torch.dtype):
    # one group of three query heads on a key head: the model's grouping, a third of its heads (the interpreter is slow)
    return make_paged_problem(BATCH, num_heads=3, num_kv_heads=1, head_dim=64, block_size=16, dtype=dtype, seed=12)


def run_steps(attention, dtype, parts: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """One launch over `parts`, each (sequence, first position, end position) of new tokens whose K/V, and all
    before them, are in the cache; returns each part's output rows."""
    p = problem(dtype)
    starts = p.query_start_loc.tolist()
    rows, q_lens, seq_lens = [], [], []
    for seq, first, end in parts:
        context = BATCH[seq][0]
        rows.append(p.query[starts[seq] + first - context: starts[seq] + end - context])
        q_lens.append(end - first)
        seq_lens.append(end)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    block_tables = p.block_tables[[seq for seq, _, _ in parts]]
    out = attention(torch.cat(rows), p.kv_cache, p.layer, block_tables, query_start_loc,
                    torch.tensor(seq_lens, dtype=torch.int32), p.scale)
    return list(out.split(q_lens))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_sequence_gives_the_same_bits_whole_cached_decoded_or_batched(backend):
    dtype = torch.bfloat16
    attention = ATTENTION[backend]
    (whole,) = run_steps(attention, dtype, [(0, 0, LENGTH)])
    expected = naive_attention(problem(dtype))[:LENGTH]
    torch.testing.assert_close(whole.double(), expected, **TOLERANCE[dtype])

    cached = 32 * 16  # a cached prefix of 32 blocks: the suffix starts exactly at the split boundary
    assert cached == INVARIANT_KEYS_PER_SPLIT
    (prefix,) = run_steps(attention, dtype, [(0, 0, cached)])
    (suffix,) = run_steps(attention, dtype, [(0, cached, LENGTH)])
    assert torch.equal(torch.cat([prefix, suffix]), whole)

    chunks = run_steps(attention, dtype, [(0, 0, 200)]) + run_steps(attention, dtype, [(0, 200, 613)])
    chunks += run_steps(attention, dtype, [(0, 613, LENGTH - 2)])
    decoded = [run_steps(attention, dtype, [(0, pos, pos + 1)])[0] for pos in (LENGTH - 2, LENGTH - 1)]
    assert torch.equal(torch.cat(chunks + decoded), whole)

    batched = run_steps(attention, dtype, [(2, 0, 37), (0, 650, LENGTH), (1, 1100, 1105), (3, 90, 91)])
    assert torch.equal(batched[1], whole[650:])
    decode_batch = run_steps(attention, dtype, [(3, 90, 91), (0, LENGTH - 1, LENGTH), (1, 1104, 1105)])
    assert torch.equal(decode_batch[1], whole[-1:])

