"""Small blocks for the lower-tier tests: two layouts, keys, token ids and payloads derived from an id."""
import torch

from kvstrata.tiers.base import BlockLayout, as_bytes

BF16 = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
FP32 = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def payload(layout: BlockLayout, i: int) -> torch.Tensor:
    """Block `i`'s bytes: random values of the layout's dtype, the same for the same `i`."""
    g = torch.Generator().manual_seed(i)
    return as_bytes(torch.randn(layout.block_shape, generator=g).to(layout.dtype)).clone()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def tokens(i: int, layout: BlockLayout = BF16) -> list[int]:
    return [1000 * i + t for t in range(layout.block_size)]
