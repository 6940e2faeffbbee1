"""Split-KV in the Triton prefix-prefill, under the interpreter (conftest sets TRITON_INTERPRET=1): a sequence's keys
cut across programs and their partial results merged by log-sum-exp must give the single pass's output, whatever
the cut. Key tiles hold 64 keys at head_dim 64 and 32 at head_dim 128, and a split holds whole tiles."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import check_prefill, make_paged_problem

from kvstrata.kernels import prefix_prefill as prefill_module
from kvstrata.kernels.prefix_prefill import (INTERPRETER_NUM_SMS, MAX_NUM_SPLITS, MIN_KEYS_PER_SPLIT,
                                             choose_num_splits, prefix_prefill, sm_count)

# (context, new tokens), contexts off block boundaries: short prefills and decodes over several key tiles (split),
# a decode and a prompt within one tile (too short to split), and a sequence with no new tokens.
RAGGED_BATCH = [(300, 16), (45, 1), (10, 0), (517, 1), (0, 5), (129, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_forced_splits_match_dense_attention_on_a_ragged_batch(num_splits, dtype):
    problem = make_paged_problem(RAGGED_BATCH, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                                 dtype=dtype, seed=num_splits)
    check_prefill(problem, dtype, num_splits=num_splits)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA groups of 1, 3 and 4
def test_split_kv_matches_dense_attention_for_each_gqa_group_and_head_dim(num_heads, num_kv_heads, head_dim,
                                                                          block_size):
    problem = make_paged_problem([(203, 16), (77, 1), (250, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, block_size=block_size, dtype=torch.float32, seed=head_dim)
    check_prefill(problem, torch.float32, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_see_none_of_a_split_take_no_weight_from_it(dtype):
    """140 keys are 3 tiles of 64, one split each. Split 2 holds keys 128..139: the first query tile (positions
    100..120) sees none of it, and in the second tile the rows at positions 121..127 see none of it either."""
    problem = make_paged_problem([(100, 40)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype,
                                 seed=5)
    check_prefill(problem, dtype, num_splits=7)


def test_automatic_choice_splits_a_short_question_over_a_long_context():
    batch = [(600, 16)]
    problem = make_paged_problem(batch, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                                 dtype=torch.float32, seed=9)
    assert sm_count(problem.query.device) == INTERPRETER_NUM_SMS
    chosen = choose_num_splits(16, 1, 9, 3, problem.block_tables.shape[1] * 16, INTERPRETER_NUM_SMS)
    assert chosen > 1  # so the automatic run below goes through the split path
    check_prefill(problem, torch.float32)


def test_choice_of_splits_follows_the_problem_size():
    h100_sms = 132
    # A 16-token question over a 7k document, SmolLM2 heads: 3 programs, cut into splits of >= 256 keys.
    assert choose_num_splits(16, 1, 9, 3, 7104, h100_sms) == 7104 // MIN_KEYS_PER_SPLIT
    # Llama-3-8B heads: 8 programs; the SMs, not the keys, bound the splits.
    assert choose_num_splits(16, 1, 32, 8, 7104, h100_sms) == h100_sms // 8
    # A decode batch of 8 over 8k contexts still leaves SMs idle: split; one of 64 fills them: single pass.
    assert choose_num_splits(8, 8, 32, 8, 8192, h100_sms) == 2
    assert choose_num_splits(64, 64, 32, 8, 8192, h100_sms) == 1
    # A long prefill fills the GPU with query tiles; short contexts are not worth cutting.
    assert choose_num_splits(4096, 1, 9, 3, 8192, h100_sms) == 1
    assert choose_num_splits(1, 1, 9, 3, 2 * MIN_KEYS_PER_SPLIT - 1, h100_sms) == 1
    # One KV head over a huge context on a big GPU: capped.
    assert choose_num_splits(1, 1, 1, 1, 1 << 20, 1024) == MAX_NUM_SPLITS


class _MustNotLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the merge kernel was launched")


def test_single_pass_launches_no_merge_kernel(monkeypatch):
    monkeypatch.setattr(prefill_module, "_merge_splits_kernel", _MustNotLaunch())
    long_context = make_paged_problem([(600, 16)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                                      dtype=torch.float32)
    check_prefill(long_context, torch.float32, num_splits=1)
    short_contexts = make_paged_problem([(40, 16), (3, 1)], num_heads=9, num_kv_heads=3, head_dim=64,
                                        block_size=16, dtype=torch.float32)
    check_prefill(short_contexts, torch.float32)  # chosen automatically: too short to split
    with pytest.raises(AssertionError, match="merge kernel was launched"):
        prefix_prefill(*long_context.args(), num_splits=2)


@pytest.mark.parametrize("num_splits", [0, MAX_NUM_SPLITS + 1, 2.0])
def test_out_of_range_split_counts_are_rejected(num_splits):
    problem = make_paged_problem([(4, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        prefix_prefill(*problem.args(), num_splits=num_splits)
