"""A Llama-family checkpoint (a folder of `config.json` and safetensors) read into plain modules, without
transformers' model classes.

Why: importing transformers' modeling code costs every process seconds before the first weight is read (it imports
torch's compiler and distributed packages), and the engine never runs that code: engine/decoder.py is its forward.
The modules here only hold the weights, under the checkpoint's own names (`model.layers.0.self_attn.q_proj.weight`),
in the layout engine/decoder.py reads from a transformers `*ForCausalLM` too: `get_decoder()` (its `embed_tokens`,
`layers`, `norm` and `rotary_emb`), `get_output_embeddings()`, `config` and `generation_config`.

Only a checkpoint understood exactly is read this way: a supported family, RoPE `default` or `llama3`, a config that
names its RoPE base and norm epsilon (family defaults are transformers' to decide), and every tensor accounted for.
Anything else gives None, and the model loader takes transformers' path: slower to start, never other outputs. Tests
check that both paths hold the same bits: parameters, tied weights and rotary tables (tests/test_checkpoint.py).
"""
from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvstrata.engine.model_spec import read_shape

logger = logging.getLogger("kvstrata")

READ_ROPE_TYPES = ("default", "llama3")  # the variants whose tables `inverse_frequencies` computes
_BENIGN_KEYS = ("rotary_emb.inv_freq",)  # saved by older transformers; recomputed here, as transformers does
_LAYER_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class CheckpointConfig:
    """The config fields the engine reads, with the whole `config.json` kept for `to_dict`."""

    raw: dict[str, Any]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope: dict[str, Any]  # rope_type, rope_theta and, for llama3, its scaling factors and pretraining context

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


@dataclass(frozen=True)
class GenerationDefaults:
    """What the engine reads of a model's generation config: its end-of-sequence token id(s)."""

    eos_token_id: int | list[int] | None


class Weights(nn.Module):
    """One weight (and bias) as its checkpoint names them: a product's `[out, in]` and bias, an embedding table or a
    norm's scale (with its epsilon). Built from the tensors read, so nothing is initialised only to be overwritten."""

    def __init__(self, state: dict[str, torch.Tensor], name: str, eps: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(state[f"{name}.weight"], requires_grad=False)
        bias = state.get(f"{name}.bias")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if eps is not None:
            self.variance_epsilon = eps


class Attention(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, config: CheckpointConfig) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, Weights(state, f"{prefix}{name}"))
        if f"{prefix}q_norm.weight" in state:  # Qwen3: each head's q and k normed before rotary
            self.q_norm = Weights(state, f"{prefix}q_norm", config.rms_norm_eps)
            self.k_norm = Weights(state, f"{prefix}k_norm", config.rms_norm_eps)
        self.scaling = config.head_dim ** -0.5


class MLP(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, Weights(state, f"{prefix}{name}"))


class DecoderLayer(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, config: CheckpointConfig) -> None:
        super().__init__()
        self.self_attn = Attention(state, f"{prefix}self_attn.", config)
        self.mlp = MLP(state, f"{prefix}mlp.")
        self.input_layernorm = Weights(state, f"{prefix}input_layernorm", config.rms_norm_eps)
        self.post_attention_layernorm = Weights(state, f"{prefix}post_attention_layernorm", config.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, `[batch, tokens, head_dim]` in `x`'s dtype, computed in float32 from
    float32 inverse frequencies: transformers' Llama-family forward, in its order (so its bits)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class DecoderBody(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor], config: CheckpointConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = Weights(state, "model.embed_tokens")
        self.layers = nn.ModuleList(DecoderLayer(state, f"model.layers.{i}.", config)
                                    for i in range(config.num_hidden_layers))
        self.norm = Weights(state, "model.norm", config.rms_norm_eps)
        self.rotary_emb = rotary


class CausalLM(nn.Module):
    """The weights of a Llama-family causal LM, named as its checkpoint names them; no forward of its own."""

    def __init__(self, state: dict[str, torch.Tensor], config: CheckpointConfig,
                 generation_config: GenerationDefaults, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = DecoderBody(state, config, rotary)
        # tied: one Parameter, as transformers ties them, so that packing or moving one moves both
        self.lm_head = self.model.embed_tokens if config.tie_word_embeddings else Weights(state, "lm_head")

    def get_decoder(self) -> DecoderBody:
        return self.model

    def get_input_embeddings(self) -> Weights:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> Weights:
        return self.lm_head


def read_checkpoint(directory: Path, dtype: torch.dtype) -> CausalLM | None:
    """The checkpoint in `directory` on the CPU, its weights in `dtype`; None when it is not one read exactly here
    (the caller then loads it with transformers). ValueError for weights files that cannot be read."""
    raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config, why_not = _checkpoint_config(raw)
    weight_files = _weight_files(directory)
    try:
        if config is not None and weight_files:
            stored = _stored_tensors(weight_files)
            if config.tie_word_embeddings:
                stored.pop("lm_head.weight", None)  # transformers ties the two whatever the file holds
            why_not = _unlike_its_config(stored, config)  # before any weight is read
        if config is None or not weight_files or why_not:
            logger.debug("kvstrata: %s is loaded by transformers (%s)", directory, why_not or "no safetensors")
            return None
        state = _read_tensors(stored, dtype)
    except SafetensorError as exc:  # a damaged or truncated file: one line, as any other load error
        raise ValueError(f"its weights are not readable safetensors ({exc})") from None
    rotary = RotaryEmbedding(inverse_frequencies(config.rope, config.head_dim))
    return CausalLM(state, config, _generation_defaults(directory, raw), rotary)


def inverse_frequencies(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """RoPE's float32 inverse frequencies, one per pair of a head's dims: `default`, or Llama 3.1's scaled ones
    (low frequencies divided by `factor`, a smooth ramp between `low_freq_factor` and `high_freq_factor`)."""
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope["rope_type"] == "default":
        return inv_freq
    factor, low, high = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_context = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _checkpoint_config(raw: dict[str, Any]) -> tuple[CheckpointConfig | None, str]:
    """The config if every field the math depends on is stated and understood; else None and why."""
    try:
        shape = read_shape(raw)
    except ValueError as exc:
        return None, str(exc)
    rope = _rope_parameters(raw, shape.rope_type)
    if rope is None or rope["rope_type"] not in READ_ROPE_TYPES:
        return None, f"RoPE {rope}"
    if raw.get("partial_rotary_factor", 1.0) != 1.0 or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None, "a partial rotary factor"
    if raw.get("quantization_config") or "rms_norm_eps" not in raw:
        return None, "a quantisation config or no rms_norm_eps"
    if shape.architecture == "Qwen3ForCausalLM" and "head_dim" not in raw:
        return None, "a Qwen3 config without head_dim"  # its family's default head_dim is not hidden / heads
    config = CheckpointConfig(raw=raw, hidden_size=int(raw["hidden_size"]), num_hidden_layers=shape.num_layers,
                              num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                              head_dim=shape.head_dim, rms_norm_eps=float(raw["rms_norm_eps"]),
                              tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), rope=rope)
    return config, ""


def _rope_parameters(raw: dict[str, Any], rope_type: str) -> dict[str, Any] | None:
    """`rope_parameters` (transformers 5), else the older `rope_theta` and `rope_scaling`, with the pretraining
    context where transformers finds it; None without a base."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in rope.values()):
        return None  # per-layer-type RoPE
    rope.setdefault("rope_theta", raw.get("rope_theta"))
    rope["rope_type"] = rope_type  # model_spec.read_shape's reading of it
    rope["original_max_position_embeddings"] = rope.get("original_max_position_embeddings") \
        or raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    return rope if rope["rope_theta"] is not None else None


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return []
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
    return [directory / name for name in sorted(set(weight_map.values()))]


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    name: str  # its name in the file (a tied pair is stored once, under one of its names)
    shape: tuple[int, ...]


def _stored_tensors(files: list[Path]) -> dict[str, StoredTensor]:
    """Where each tensor of the checkpoint is, by name, without reading it; the embedding under both its names when
    the file kept a tied pair once (safetensors names the other in its metadata)."""
    stored: dict[str, StoredTensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if not name.endswith(_BENIGN_KEYS):
                    stored[name] = StoredTensor(file, name, tuple(f.get_slice(name).get_shape()))
            for alias, name in (f.metadata() or {}).items():
                if name in names and alias.startswith(("model.", "lm_head.")) and alias not in stored:
                    stored[alias] = stored[name]
    return stored


def _read_tensors(stored: dict[str, StoredTensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors in `dtype`, cast one by one (a model is never held in two dtypes at once), each file opened once."""
    by_file: dict[Path, list[str]] = {}
    for name, where in stored.items():
        by_file.setdefault(where.file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                state[name] = f.get_tensor(stored[name].name).to(dtype)
    return state


def _unlike_its_config(stored: dict[str, StoredTensor], config: CheckpointConfig) -> str:
    """Why the tensors are not exactly a Llama-family model's of this config (names and head sizes); "" if they are.
    Biases and Qwen3's q/k norms are read off the names."""
    first = "model.layers.0."
    biases = [key for key in _LAYER_KEYS if f"{first}{key}.bias" in stored]
    norms = ["self_attn.q_norm", "self_attn.k_norm"] if f"{first}self_attn.q_norm.weight" in stored else []
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        expected |= {f"{layer}{key}.weight" for key in (*_LAYER_KEYS, *norms, "input_layernorm",
                                                           "post_attention_layernorm")}
        expected |= {f"{layer}{key}.bias" for key in biases}
    if set(stored) != expected:
        return f"tensors {sorted(set(stored) ^ expected)[:3]} are not those of its config"
    rows = tuple(stored[f"{first}self_attn.{p}_proj.weight"].shape[0] for p in "qk")
    if rows != (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim):
        return "q_proj's or k_proj's rows are not its heads x head_dim"
    return ""


def _generation_defaults(directory: Path, raw: dict[str, Any]) -> GenerationDefaults:
    """generation_config.json's end-of-sequence id(s), or the config's where it has none (as transformers does)."""
    try:
        generation = json.loads((directory / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        generation = {}
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    return GenerationDefaults(eos if eos is not None else raw.get("eos_token_id"))
