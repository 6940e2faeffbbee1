"""Chain hashing: the properties every tier relies on to find a prefix by its hash."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.engine.hashing import BlockHasher, block_hashes, make_namespace

BLOCK_SIZE = 4
NAMESPACE = make_namespace("smollm2-135m-instruct", "bfloat16", BLOCK_SIZE, 1, "xxh3_128")
TOKENS = [(i * 7919 + 13) % 49152 for i in range(37)]  # 9 full blocks + 1 partial


def hashes_of(tokens, **kwargs):
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("namespace", NAMESPACE)
    return block_hashes(tokens, **kwargs)


def test_same_inputs_give_same_hashes():
    assert hashes_of(TOKENS) == hashes_of(list(TOKENS))
    assert hashes_of(TOKENS, cache_salt="s", extra_keys=[1] * 9) == hashes_of(TOKENS, cache_salt="s", extra_keys=[1] * 9)


def test_hashes_are_identical_in_a_fresh_interpreter():
    program = (
        "from kvstrata.engine.hashing import block_hashes, make_namespace\n"
        f"ns = make_namespace('smollm2-135m-instruct', 'bfloat16', {BLOCK_SIZE}, 1, 'xxh3_128')\n"
        f"tokens = {TOKENS!r}\n"
        f"plain = block_hashes(tokens, block_size={BLOCK_SIZE}, namespace=ns)\n"
        f"salted = block_hashes(tokens, block_size={BLOCK_SIZE}, namespace=ns, cache_salt='s', algo='xxh3_128')\n"
        "print(','.join(h.hex() for h in plain + salted))\n"
    )
    # A different PYTHONHASHSEED would change anything built on Python's hash(); ours must not move.
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": "12345"})
    expected = hashes_of(TOKENS) + hashes_of(TOKENS, cache_salt="s")
    assert result.stdout.strip() == ",".join(h.hex() for h in expected)


def test_one_hash_per_full_block_and_partial_block_not_hashed():
    assert len(hashes_of(TOKENS)) == len(TOKENS) // BLOCK_SIZE
    assert hashes_of(TOKENS[:3]) == []
    assert hashes_of(TOKENS[:36]) == hashes_of(TOKENS[:37]) == hashes_of(TOKENS[:39])
    assert len(hashes_of(TOKENS + [1, 2, 3])) == 10  # the partial block, once full, gets its hash


def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes():
    full = hashes_of(TOKENS)
    for num_tokens in range(len(TOKENS) + 1):
        assert hashes_of(TOKENS[:num_tokens]) == full[:num_tokens // BLOCK_SIZE]


@pytest.mark.parametrize("block_index", [0, 3, 8])
def test_changing_one_token_changes_its_block_and_all_later_hashes_only(block_index):
    changed = list(TOKENS)
    changed[block_index * BLOCK_SIZE + 2] += 1
    before, after = hashes_of(TOKENS), hashes_of(changed)
    assert before[:block_index] == after[:block_index]
    for i in range(block_index, len(before)):
        assert before[i] != after[i]


def test_cache_salt_changes_every_hash():
    plain = hashes_of(TOKENS)
    salted_a = hashes_of(TOKENS, cache_salt="tenant-a")
    salted_b = hashes_of(TOKENS, cache_salt="tenant-b")
    assert len(plain) == len(salted_a) == len(salted_b)
    assert set(plain).isdisjoint(salted_a)
    assert set(salted_a).isdisjoint(salted_b)
    # An empty salt is still a salt: it must not coincide with no salt.
    assert set(plain).isdisjoint(hashes_of(TOKENS, cache_salt=""))


def test_cache_salt_is_not_the_same_as_equal_extra_keys_on_the_first_block():
    salted = hashes_of(TOKENS, cache_salt="x")
    assert salted[0] != hashes_of(TOKENS, extra_keys=["x"] + [None] * 8)[0]
    assert salted[0] != hashes_of(TOKENS, extra_keys=[["x", None]] + [None] * 8)[0]


def test_extra_keys_change_their_block_and_later_hashes_only():
    plain = hashes_of(TOKENS)
    extra = [None] * 9
    assert hashes_of(TOKENS, extra_keys=extra) == plain  # None means "no extra keys"
    extra[4] = ("lora", 7)
    keyed = hashes_of(TOKENS, extra_keys=extra)
    assert keyed[:4] == plain[:4]
    assert set(keyed[4:]).isdisjoint(plain[4:])


def test_extra_keys_shorter_than_the_full_blocks_is_an_error():
    with pytest.raises(ValueError, match="extra_keys"):
        hashes_of(TOKENS, extra_keys=[None] * 8)


def test_different_namespaces_give_disjoint_hashes():
    others = [
        make_namespace("other-model", "bfloat16", BLOCK_SIZE, 1, "xxh3_128"),
        make_namespace("smollm2-135m-instruct", "float32", BLOCK_SIZE, 1, "xxh3_128"),
        make_namespace("smollm2-135m-instruct", "bfloat16", BLOCK_SIZE, 2, "xxh3_128"),
        make_namespace("smollm2-135m-instruct", "bfloat16", 8, 1, "xxh3_128"),
        make_namespace("smollm2-135m-instruct", "bfloat16", BLOCK_SIZE, 1, "xxh3_128", kv_dtype="float8_e4m3fn"),
        make_namespace("smollm2-135m-instruct", "bfloat16", BLOCK_SIZE, 1, "xxh3_128", kv_dtype="float8_e5m2"),
    ]
    assert len(set(others + [NAMESPACE])) == 7
    plain = set(hashes_of(TOKENS))
    for namespace in others:
        assert plain.isdisjoint(hashes_of(TOKENS, namespace=namespace))


def test_namespace_is_canonical_and_validated():
    assert make_namespace("m", "bfloat16", 16, 1, "sha256") == make_namespace("m", "bfloat16", 16, 1, "sha256")
    # K/V kept in the model's own dtype are the blocks they always were: stores written before stay valid
    assert make_namespace("m", "bfloat16", 16, 1, "sha256", kv_dtype="bfloat16") == \
        make_namespace("m", "bfloat16", 16, 1, "sha256")
    with pytest.raises(ValueError, match="algorithm"):
        make_namespace("m", "bfloat16", 16, 1, "md5")
    with pytest.raises(ValueError, match="block_size"):
        make_namespace("m", "bfloat16", 0, 1, "sha256")
    with pytest.raises(ValueError, match="model_id"):
        make_namespace("", "bfloat16", 16, 1, "sha256")


@pytest.mark.parametrize("cache_salt", [None, "s"])
def test_incremental_extend_equals_full_recompute(cache_salt):
    hasher = BlockHasher(BLOCK_SIZE, NAMESPACE)
    hashes = hasher.hash(TOKENS[:5], cache_salt=cache_salt)
    assert len(hashes) == 1
    seen_new = list(hashes)
    for num_tokens in range(6, len(TOKENS) + 1):  # one decode step at a time
        new = hasher.extend(hashes, TOKENS[:num_tokens], cache_salt=cache_salt)
        assert len(new) == (1 if num_tokens % BLOCK_SIZE == 0 else 0)
        seen_new += new
    full = hashes_of(TOKENS, cache_salt=cache_salt)
    assert hashes == full == seen_new


def test_extend_from_nothing_and_by_many_blocks_at_once():
    hasher = BlockHasher(BLOCK_SIZE, NAMESPACE)
    hashes: list[bytes] = []
    assert hasher.extend(hashes, TOKENS[:3], cache_salt="s") == []
    assert hasher.extend(hashes, TOKENS[:9], cache_salt="s") == hashes_of(TOKENS[:9], cache_salt="s")
    new = hasher.extend(hashes, TOKENS, cache_salt="s")
    assert len(new) == 7 and hashes == hashes_of(TOKENS, cache_salt="s")


def test_extend_with_extra_keys_equals_full_recompute():
    extra = [None, 1, None, "x", None, None, (2, 3), None, None, "ignored-partial"]
    hasher = BlockHasher(BLOCK_SIZE, NAMESPACE)
    hashes = hasher.hash(TOKENS[:10], extra_keys=extra)
    hasher.extend(hashes, TOKENS, extra_keys=extra)
    assert hashes == hashes_of(TOKENS, extra_keys=extra)


def test_continuing_from_a_parent_ignores_the_salt_already_in_the_chain():
    full = hashes_of(TOKENS, cache_salt="s")
    tail = hashes_of(TOKENS[12:], parent=full[2], cache_salt="s")
    assert full[:3] + tail == full


def test_list_numpy_and_torch_inputs_agree():
    expected = hashes_of(TOKENS)
    assert hashes_of(tuple(TOKENS)) == expected
    assert hashes_of(np.array(TOKENS, dtype=np.int64)) == expected
    assert hashes_of(np.array(TOKENS, dtype=np.uint32)) == expected
    assert hashes_of(np.array(TOKENS, dtype=">u4")) == expected
    assert hashes_of(torch.tensor(TOKENS, dtype=torch.int64)) == expected
    assert hashes_of(torch.tensor(TOKENS, dtype=torch.int32)) == expected
    hasher = BlockHasher(BLOCK_SIZE, NAMESPACE)
    hashes = hasher.hash(torch.tensor(TOKENS[:10]))
    hasher.extend(hashes, torch.tensor(TOKENS))
    assert hashes == expected


def test_out_of_range_or_non_integer_tokens_are_rejected():
    for bad in ([1, -1, 2, 3], np.array([1, -1, 2, 3]), [1.5, 2, 3, 4], np.array([1.0, 2, 3, 4]),
                torch.tensor([0, 2**32, 1, 2]), np.zeros((2, 4), dtype=np.int64)):
        with pytest.raises(ValueError, match="token"):
            hashes_of(bad)


def test_sha256_gives_32_byte_hashes_with_the_same_properties():
    namespace = make_namespace("smollm2-135m-instruct", "bfloat16", BLOCK_SIZE, 1, "sha256")
    hashes = hashes_of(TOKENS, namespace=namespace, algo="sha256")
    assert len(hashes) == 9 and all(len(h) == 32 for h in hashes)
    assert hashes_of(TOKENS[:20], namespace=namespace, algo="sha256") == hashes[:5]
    hasher = BlockHasher(BLOCK_SIZE, namespace, algo="sha256")
    incremental = hasher.hash(TOKENS[:6])
    hasher.extend(incremental, TOKENS)
    assert incremental == hashes
    assert all(len(h) == 16 for h in hashes_of(TOKENS))  # xxh3_128


def test_unknown_algorithm_or_mismatched_parent_is_an_error():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        hashes_of(TOKENS, algo="md5")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(BLOCK_SIZE, NAMESPACE, algo="crc32")
    with pytest.raises(ValueError, match="parent"):
        hashes_of(TOKENS, parent=b"\0" * 32)  # a sha256-sized parent in an xxh3_128 chain
    with pytest.raises(ValueError, match="block_size"):
        hashes_of(TOKENS, block_size=0)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60), block_size=st.integers(1, 8),
       steps=st.lists(st.integers(0, 12), max_size=8), cache_salt=st.one_of(st.none(), st.text(max_size=3)))
def test_any_sequence_of_extends_equals_hashing_the_whole_sequence(tokens, block_size, steps, cache_salt):
    hasher = BlockHasher(block_size, NAMESPACE)
    hashes: list[bytes] = []
    num_tokens = 0
    for step in steps + [len(tokens)]:
        num_tokens = min(len(tokens), num_tokens + step)
        hasher.extend(hashes, tokens[:num_tokens], cache_salt=cache_salt)
    full = block_hashes(tokens, block_size=block_size, namespace=NAMESPACE, cache_salt=cache_salt)
    assert hashes == full
    assert len(set(full)) == len(full)  # a chain never repeats a hash, even over repeated tokens
