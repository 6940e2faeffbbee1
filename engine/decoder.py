"""The decoder's forward pass over the paged KV cache: a Llama-family model's layers (Llama, Mistral, Qwen2,
Qwen3), run on the loaded model's own weights by kvstrata's kernels rather than through transformers' modules.

Why not transformers' forward: on a GPU a step with few tokens (a decode, a question after a cached document) is
bound by the host, not the device: a 135M model and an 8B one took about the same time a step, the Python of
transformers' modules and the ~45 small kernels a layer launches (its RMSNorm alone is eight). Here a layer is
one function launching about 11: a fused residual-add-and-RMSNorm, one product for q, k and v, rotary embedding
of q and k in one kernel, the K/V store, attention, the output product, the second add-and-norm, one product for
the MLP's gate and up, SiLU-and-multiply, the down product (kernels/layer_ops.py). It is also the shape a captured
CUDA graph needs: every launch comes from this file.

The math is transformers' (the torch references are its code, in its order), so on the torch path a step computes
what transformers computes; the packed products are the only change, a wider matrix per product (see `pack`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

IntSeq = torch.Tensor | Sequence[int]


@dataclass
class StepInput:
    """One scheduler step, every sequence's new tokens packed back to back (vLLM v1 names).

    `logits_indices` are the packed rows whose next-token logits are wanted: usually each sequence's
    last new token, and none for a sequence whose prefill chunk does not reach its prompt's end.
    Fields may be CPU tensors or plain lists; the model runner moves them to the model's device (as tensors on
    it, the runner's forward pass and a recorded CUDA graph read them).
    """

    input_ids: IntSeq        # [T]
    positions: IntSeq        # [T] position of each token in its sequence
    slot_mapping: IntSeq     # [T] block_id * block_size + offset
    block_tables: torch.Tensor | Sequence[Sequence[int]]  # [B, max_blocks], rows padded (any value)
    query_start_loc: IntSeq  # [B+1]
    seq_lens: IntSeq         # [B] cached context + new tokens
    logits_indices: IntSeq   # [B']


@dataclass
class AttentionMetadata:
    """One step's view of the paged KV cache, built once per step by the model runner and read by every layer;
    the tokens of all sequences are packed back to back.

    Invariants: `slot_mapping[i]` is where token i's K/V go (`block_id * block_size + offset`);
    `query_start_loc[b]:query_start_loc[b+1]` are sequence b's new tokens; `seq_lens[b]` counts its
    cached context plus those new tokens; `block_tables[b]` covers `seq_lens[b]` positions.
    """

    slot_mapping: torch.Tensor     # [T] int64
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    kv_cache: torch.Tensor         # [num_blocks, num_layers, 2, block_size, num_kv_heads, row] (kernels/kv_format.py)
    scale: float | None = None     # softmax scale; None = the layer's own (1/sqrt(head_dim))


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights: the products packed (q, k, v rows side by side; gate then up)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: an RMSNorm over each head's dims of q and of k, before rotary
    k_norm: torch.Tensor | None
    scale: float                 # the attention's softmax scale


def pack(linears: list[torch.nn.Linear], transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for `linears` side by side, so that one product computes them all. The modules'
    parameters become views of the packed tensor: the weights are held once, and transformers' own forward on
    the same model (tests compare against it) still runs. Packing a model a second time (another engine on the
    same loaded model) finds its weights packed already and copies nothing.

    `transposed`: the pack is stored `[in_features, out_features]`, row-major, and the weight returned (and each
    module's) is its transposed view, still `[out, in]` as `F.linear` takes it. On a CPU, `F.linear` then runs
    MKL's plain `x @ W` product, which skips the transposing copy of the weight that the `x @ W.T` form makes on
    every call: a copy as large as the weight, for a step of one row or ten."""
    weight = _packed([m.weight for m in linears], transposed)
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        raise ValueError("model: some of the packed projections have a bias and some not")
    return weight, _packed(biases)


def _packed(parts: list[torch.Tensor], transposed: bool = False) -> torch.Tensor:
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    transposed = transposed and first.dim() == 2  # biases are vectors either way
    if _adjacent(parts, transposed):
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    if transposed:
        packed = torch.cat([p.detach().t() for p in parts], dim=1).t()  # [in, out] storage, seen as [out, in]
    else:
        packed = torch.cat([p.detach() for p in parts])
    for part, view in zip(parts, packed.split([p.shape[0] for p in parts])):
        part.data = view  # the Parameter object stays (transformers' modules keep theirs); its storage is the pack's
    return packed


def _adjacent(parts: list[torch.Tensor], transposed: bool) -> bool:
    """The parts follow each other, row after row, in one storage laid out as asked (a pack's views)."""
    rows = sum(p.shape[0] for p in parts)
    layout = (1, rows) if transposed else parts[0][:1].contiguous().stride()
    storage = parts[0].untyped_storage().data_ptr()
    offset = parts[0].storage_offset()
    for part in parts:
        if part.untyped_storage().data_ptr() != storage or part.stride() != layout or part.storage_offset() != offset:
            return False
        offset += part.shape[0] * layout[0]
    return True


def store_transposed(weight: torch.nn.Parameter) -> None:
    """Keep a `[out, in]` weight stored `[in, out]`, seen through its transposed view (see `pack`): the vocabulary
    product of a step's last rows then skips the transposing copy too. A tied embedding is the same parameter:
    its lookups read a few rows through the strides, which costs little."""
    if weight.dim() == 2 and weight.is_contiguous():
        weight.data = weight.detach().t().contiguous().t()


def layer_weights(layer: torch.nn.Module, transposed: bool = False) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = pack([attn.q_proj, attn.k_proj, attn.v_proj], transposed)
    gate_up, gate_up_bias = pack([mlp.gate_proj, mlp.up_proj], transposed)
    o, down = (pack([attn.o_proj], transposed)[0], pack([mlp.down_proj], transposed)[0])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight, post_attention_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon, qkv=qkv, qkv_bias=qkv_bias,
        o=o, o_bias=attn.o_proj.bias, gate_up=gate_up, gate_up_bias=gate_up_bias,
        down=down, down_bias=mlp.down_proj.bias,
        q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        scale=attn.scaling)


class Decoder:
    """The transformer body of a loaded `*ForCausalLM`: token ids in, final normalised hidden states out."""

    def __init__(self, model: torch.nn.Module, ops) -> None:
        body = model.get_decoder()
        config = model.config
        self.ops = ops
        self.embed = body.embed_tokens.weight
        self.rotary_embedding = body.rotary_emb  # transformers' own: every RoPE variant (Llama 3's scaling) as it is
        self.final_norm = body.norm.weight
        self.final_eps = body.norm.variance_epsilon
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # the CPU's products take their weights transposed (see `pack`); a GPU's, and Triton's, as loaded
        self.transposed = ops.name in ("torch", "cpu") and self.embed.device.type == "cpu"
        # the products: `F.linear` (which the invariant mode routes to `ops.linear`), or the backend's faster kernel
        self.linear = ops.model_linear or F.linear
        self.layers = [layer_weights(layer, self.transposed) for layer in body.layers[:config.num_hidden_layers]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`input_ids` and `positions` `[T]` -> hidden states `[T, hidden]` after the final norm. Each layer's K/V
        are stored into the cache before its attention reads them."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = (t[0] for t in self.rotary_embedding(hidden, positions[None]))
        delta, residual = hidden, None  # each layer's input is residual + delta, summed by the norm that reads it
        for index, layer in enumerate(self.layers):
            delta, residual = self._layer(index, layer, delta, residual, cos, sin, meta)
        out, _ = self.ops.rms_norm(delta, self.final_norm, self.final_eps, residual)
        return out

    def _layer(self, index: int, layer: LayerWeights, delta: torch.Tensor, residual: torch.Tensor | None,
               cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: returns what it adds to the residual stream (its MLP's output) and the stream before that."""
        ops = self.ops
        num_tokens = delta.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x, residual = ops.rms_norm(delta, layer.input_norm, layer.eps, residual)
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
        if layer.q_norm is not None:
            qk = torch.cat([ops.rms_norm(qk[:, :heads], layer.q_norm, layer.eps)[0],
                            ops.rms_norm(qk[:, heads:], layer.k_norm, layer.eps)[0]], dim=1)
        qk = ops.rotary(qk, cos, sin)
        query, key = qk[:, :heads], qk[:, heads:]
        value = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
        ops.store_kv(key, value, meta.kv_cache, index, meta.slot_mapping)
        scale = meta.scale if meta.scale is not None else layer.scale
        attention = ops.prefix_prefill(query, meta.kv_cache, index, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, scale)
        delta = self.linear(attention.reshape(num_tokens, heads * head_dim), layer.o, layer.o_bias)
        x, residual = ops.rms_norm(delta, layer.post_attention_norm, layer.eps, residual)
        gate_up = self.linear(x, layer.gate_up, layer.gate_up_bias)
        return self.linear(ops.silu_and_mul(gate_up), layer.down, layer.down_bias), residual
