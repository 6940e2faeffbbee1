"""Chain hashing of token blocks: the key every tier stores a KV block under.

A request's tokens are split into full blocks of `block_size`; block i is named by

    h_i = H(h_{i-1} || tokens_i || cbor(extra_keys_i)),      h_{-1} = H(namespace)

so a hash names the whole prefix up to and including its block, not just the block's own
tokens. Invariants users rely on (docs/design.md, "Invariants"):

- Same tokens + same extra keys + same namespace -> same hashes, in every process and after
  restarts: only byte-level, seedless hashes are used (never Python's `hash()`), and tokens are
  laid out as little-endian uint32 whatever the input type (list, numpy array, torch tensor).
- The namespace (model identity, dtype, block size, KV layout version, hash algorithm) seeds the
  chain, so two models never share a key.
- `cache_salt` enters the first block only (folded into its extra keys); since every later hash
  chains on the first, it changes the whole chain.
- Only full blocks are hashed: a partial last block has no hash until it fills.
- The hashes of a prefix are a prefix of the hashes: `block_hashes(t[:k * block_size])` equals
  `block_hashes(t)[:k]`, and continuing from `parent=hashes[-1]` gives the same chain as hashing
  everything again (the incremental form used during decode, `BlockHasher.extend`).

The concatenation is unambiguous: within one chain every digest has the same length, the token
part of a block is exactly `4 * block_size` bytes, and an item of `extra_keys` that is None adds
no bytes while any other item adds its CBOR encoding, which is never empty.

Speed: tokens become bytes once for the whole input (one C-level conversion), then each block is
one slice, one concatenation and one digest call. There is no per-token Python work.
"""
from __future__ import annotations

import array
import hashlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import cbor2
import numpy as np
import xxhash

# Bump when the way blocks are turned into hash input changes: it is folded into every namespace,
# so hashes written by an older scheme (e.g. in the disk tier) simply stop matching.
HASH_SCHEME_VERSION = 1

# A CBOR tag from the unassigned range wraps (cache_salt, extra_keys_0) in the first block, so a
# salted block can never encode like an unsalted one whose own extra keys look the same.
CACHE_SALT_CBOR_TAG = 0x6B7673  # "kvs"

TOKEN_DTYPE = np.dtype("<u4")
TOKEN_NBYTES = TOKEN_DTYPE.itemsize

DigestFn = Callable[[bytes], bytes]


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_ALGOS: dict[str, DigestFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,  # 16-byte digests
    "sha256": _sha256_digest,            # 32-byte digests
}


def get_digest_fn(algo: str) -> DigestFn:
    """The one-shot digest function for `algo`; ValueError naming the choices if unknown."""
    try:
        return HASH_ALGOS[algo]
    except (KeyError, TypeError):
        raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {sorted(HASH_ALGOS)}") from None


# 1: one product per row; 2: rows in fixed tiles per CPU family; 3: the attention backend named beside it (a
# CPU's compiled kernel, kernels/cpu_attention.py, sums in other tiles than the torch path), and AVX2 float32
# products padded to a multiple of 4 rows instead of 16-row tiles; 4: backend "cpu"'s products by its compiled
# kernel (kernels/cpu_linear.py: one in-order reduction over K per element, no padding, every CPU family).
BATCH_INVARIANT_VERSION = 4


def make_namespace(model_id: str, dtype: str, block_size: int, kv_layout_version: int, algo: str,
                   batch_invariant: bool = False, kv_dtype: str | None = None, attention: str | None = None) -> bytes:
    """The canonical CBOR encoding of everything that makes a KV block mean something.

    Two engines share a hash only if they run the same model in the same dtype with the same
    block size, KV layout and hash algorithm (and hashing scheme). Canonical CBOR sorts map keys,
    so the bytes do not depend on argument or dict order. `batch_invariant` K/V are computed in
    another order, so their bits differ: the mode gets its own namespace (and without it the
    namespace is what it always was, so existing stores stay valid). K/V kept in another dtype than
    the model's (`kv_dtype`, e.g. fp8) are other bytes too: their own namespace, the same way. In
    batch-invariant mode the attention backend (`attention`: "cpu", "torch" or "triton") is named too:
    each sums in its own fixed order, so their K/V are other bits, and an engine whose backend fell back
    (no C compiler for "cpu") must not serve another's blocks as its own.
    """
    get_digest_fn(algo)
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"dtype must be a non-empty string such as 'bfloat16', got {dtype!r}")
    _check_block_size(block_size)
    if isinstance(kv_layout_version, bool) or not isinstance(kv_layout_version, int):
        raise ValueError(f"kv_layout_version must be an int, got {kv_layout_version!r}")
    fields = {
        "model_id": model_id,
        "dtype": dtype,
        "block_size": block_size,
        "kv_layout_version": kv_layout_version,
        "algo": algo,
        "hash_scheme": HASH_SCHEME_VERSION,
    }
    if batch_invariant:
        # The mode's own version: its products changed form (rows in fixed tiles, not one by one), so
        # K/V stored by an earlier form are other bits and must not mix with new ones.
        fields["batch_invariant"] = BATCH_INVARIANT_VERSION
        if attention is not None:
            fields["attention"] = attention
    if kv_dtype is not None and kv_dtype != dtype:
        fields["kv_dtype"] = kv_dtype
    return cbor2.dumps(fields, canonical=True)


def block_hashes(
    token_ids: Any,
    *,
    block_size: int,
    namespace: bytes,
    cache_salt: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    algo: str = "xxh3_128",
    parent: bytes | None = None,
) -> list[bytes]:
    """One chained hash per FULL block of `token_ids` (a partial last block is not hashed).

    `token_ids`: a list of ints, a 1-D numpy array or a 1-D torch tensor of ids in [0, 2**32).
    `extra_keys`: None, or one item per full block (further items are ignored), each None or
    CBOR-encodable; it distinguishes blocks whose tokens are equal but whose KV is not (e.g.
    multimodal inputs, LoRA).
    `parent`: continue the chain from this hash instead of the namespace seed: `token_ids` are
    then the tokens after the blocks `parent` covers, and `cache_salt` is ignored, because it
    entered the chain at its first block and is already folded into `parent`.
    """
    digest = get_digest_fn(algo)
    _check_block_size(block_size)
    token_bytes = tokens_as_bytes(token_ids)
    block_nbytes = block_size * TOKEN_NBYTES
    num_full_blocks = len(token_bytes) // block_nbytes

    if parent is None:
        prev = digest(bytes(namespace))
        salt = cache_salt
    else:
        prev = bytes(parent)
        digest_nbytes = len(digest(b""))
        if len(prev) != digest_nbytes:
            raise ValueError(f"parent hash is {len(prev)} bytes, but {algo} digests are {digest_nbytes} bytes")
        salt = None

    suffixes = _extra_key_suffixes(num_full_blocks, extra_keys, salt)
    hashes: list[bytes] = []
    append = hashes.append
    if suffixes is None:  # the common case: no extra keys, no salt in this stretch of the chain
        for start in range(0, num_full_blocks * block_nbytes, block_nbytes):
            prev = digest(prev + token_bytes[start:start + block_nbytes])
            append(prev)
    else:
        for i, suffix in enumerate(suffixes):
            start = i * block_nbytes
            prev = digest(prev + token_bytes[start:start + block_nbytes] + suffix)
            append(prev)
    return hashes


class BlockHasher:
    """`block_hashes` bound to one namespace, with the incremental form the engine uses in decode.

    A request keeps its list of hashes; after each step `extend` hashes only the blocks that
    became full since, chaining on the last known hash. `extend` then equals a full recompute.
    """

    @classmethod
    def for_model(cls, model_identity: str, dtype: str, block_size: int, algo: str,
                  batch_invariant: bool = False, kv_dtype: str | None = None,
                  attention: str | None = None) -> BlockHasher:
        """The hasher of an engine running `model_identity` in `dtype`: the engine and `kvstrata route`
        both build theirs here, so that they name every block alike."""
        from kvstrata.tiers.base import KV_LAYOUT_VERSION
        namespace = make_namespace(model_identity, dtype, block_size, KV_LAYOUT_VERSION, algo,
                                   batch_invariant=batch_invariant, kv_dtype=kv_dtype, attention=attention)
        return cls(block_size, namespace, algo)

    def __init__(self, block_size: int, namespace: bytes, algo: str = "xxh3_128") -> None:
        get_digest_fn(algo)
        _check_block_size(block_size)
        self.block_size = block_size
        self.namespace = bytes(namespace)
        self.algo = algo

    def hash(self, token_ids: Any, cache_salt: str | None = None,
             extra_keys: Sequence[Any] | None = None) -> list[bytes]:
        """Hashes of every full block of `token_ids` from the start of the chain."""
        return block_hashes(token_ids, block_size=self.block_size, namespace=self.namespace,
                            cache_salt=cache_salt, extra_keys=extra_keys, algo=self.algo)

    def extend(self, hashes: list[bytes], token_ids: Any, cache_salt: str | None = None,
               extra_keys: Sequence[Any] | None = None) -> list[bytes]:
        """Append to `hashes` (in place) the hashes of blocks of `token_ids` that became full.

        `hashes` must be the hashes of the first `len(hashes)` blocks of `token_ids` (as returned
        by `hash` or earlier `extend` calls); `token_ids` is the whole sequence so far and
        `extra_keys`, if given, one item per block of the whole sequence. Returns the new hashes.
        """
        num_known = len(hashes)
        num_full_blocks = len(token_ids) // self.block_size
        if num_full_blocks <= num_known:
            return []
        start, end = num_known * self.block_size, num_full_blocks * self.block_size
        new_extra_keys = None if extra_keys is None else extra_keys[num_known:num_full_blocks]
        new_hashes = block_hashes(
            token_ids[start:end], block_size=self.block_size, namespace=self.namespace,
            cache_salt=cache_salt, extra_keys=new_extra_keys, algo=self.algo,
            parent=hashes[-1] if hashes else None)
        hashes.extend(new_hashes)
        return new_hashes


MAX_NAMESPACE_BYTES = 4096  # a namespace is a few hundred bytes of CBOR; a naming read from afar is checked


@dataclass(frozen=True)
class BlockNaming:
    """How an engine names its KV blocks, all a router needs to name a prompt's blocks as that engine's KV events
    do: the namespace, block size and hash algorithm. `model` is the identity the namespace was made from (the
    namespace is a digest input, not readable): a router tells by it a replica serving another model, whose
    prompts it would tokenize otherwise, from one merely configured otherwise (another dtype, say)."""

    model: str
    namespace: bytes
    block_size: int
    algo: str

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.block_size, self.namespace, self.algo)

    def to_json(self) -> dict:
        return {"model": self.model, "namespace": self.namespace.hex(), "block_size": self.block_size,
                "hash": self.algo}

    @classmethod
    def from_json(cls, data: Any) -> BlockNaming:
        """The naming `to_json` wrote; ValueError, one line, for anything else."""
        if not isinstance(data, dict):
            raise ValueError(f"a block naming is an object, got {type(data).__name__}")
        model, namespace, block_size, algo = (data.get(k) for k in ("model", "namespace", "block_size", "hash"))
        if not isinstance(model, str) or not model:
            raise ValueError("a block naming's model must be a non-empty string")
        if not isinstance(namespace, str) or len(namespace) > 2 * MAX_NAMESPACE_BYTES:
            raise ValueError("a block naming's namespace must be a hex string")
        if not isinstance(algo, str):
            raise ValueError("a block naming's hash must be a string")
        naming = cls(model, bytes.fromhex(namespace), block_size, algo)  # fromhex: ValueError for non-hex
        naming.hasher()  # checks the block size and the algorithm
        return naming


def tokens_as_bytes(token_ids: Any) -> bytes:
    """All token ids as little-endian uint32 bytes, converted in one call (never per token in Python).

    A list goes through `array.array` (a C loop, faster than numpy's conversion of a
    list), a numpy array or torch tensor through numpy; both give the same `'<u4'` bytes.
    """
    if isinstance(token_ids, (list, tuple)):
        return _int_list_as_bytes(token_ids)
    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # a torch tensor, without importing torch
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        return _int_array_as_bytes(token_ids)
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        raise ValueError(f"token_ids must be integers, got {type(token_ids).__name__}")
    return _int_list_as_bytes(list(token_ids))


_ARRAY_U32_CODE = next((code for code in "IL" if array.array(code).itemsize == TOKEN_NBYTES), None)


def _int_list_as_bytes(token_ids: Sequence[int]) -> bytes:
    if _ARRAY_U32_CODE is None:  # no 4-byte unsigned C type: let numpy convert
        return _int_array_as_bytes(np.asarray(token_ids))
    try:
        values = array.array(_ARRAY_U32_CODE, token_ids)
    except OverflowError:
        raise ValueError("token ids must lie in [0, 2**32)") from None
    except TypeError as err:
        raise ValueError(f"token ids must be integers: {err}") from None
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def _int_array_as_bytes(token_ids: np.ndarray) -> bytes:
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {token_ids.shape}")
    if token_ids.dtype == TOKEN_DTYPE:
        return token_ids.tobytes()
    if token_ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return token_ids.astype(TOKEN_DTYPE).tobytes()


def _extra_key_suffixes(num_full_blocks: int, extra_keys: Sequence[Any] | None,
                        cache_salt: str | None) -> list[bytes] | None:
    """The bytes appended to each block's tokens, or None when every suffix is empty."""
    if extra_keys is None and cache_salt is None:
        return None
    if extra_keys is None:
        extra_keys = [None] * num_full_blocks
    elif len(extra_keys) < num_full_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} items but there are {num_full_blocks} full blocks")
    suffixes = [b"" if key is None else cbor2.dumps(key, canonical=True)
                for key in extra_keys[:num_full_blocks]]
    if cache_salt is not None and num_full_blocks > 0:
        salted = cbor2.CBORTag(CACHE_SALT_CBOR_TAG, [cache_salt, extra_keys[0]])
        suffixes[0] = cbor2.dumps(salted, canonical=True)
    return suffixes


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
