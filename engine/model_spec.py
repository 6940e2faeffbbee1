"""What a model is made of, read without loading it: its architecture and the shape of its KV cache.

Config validation needs a block's byte size (to check tier sizes given as block counts) and the
model's context limit (to check `model.max_model_len`) before any weight is read, and
`kvstrata config check` must stay free of torch and transformers. So this module reads shapes from
plain data: a model directory's `config.json`, a named preset for random-weight models
(`load_format: dummy`), or the embedded model's known shape. The engine reads the loaded model's
config through the same `read_shape`, so both sides agree on one definition.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvstrata.kernels.kv_format import row_width

EMBEDDED_MODEL = "smollm2-135m-instruct"
DTYPE_NBYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}

# The families whose attention kvstrata runs: a decoder-only transformer with rotary positions,
# (grouped-query) attention over `head_dim`-sized heads and nothing else that reads past tokens.
# Each has a test on a tiny random checkpoint (tests/test_model_families.py).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# transformers configs of models that `load_format: dummy` builds with random weights, so figures
# for realistic model sizes need no downloaded weights. The vocabulary is the embedded tokenizer's
# whatever the preset says (see `model_loader.build_dummy_model`).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    # small enough for tests on a CPU: two layers, grouped-query attention, 2.3M parameters
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 49152, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class ModelShape:
    """The facts about a model that size its KV cache and bound its context."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # the longest sequence kvstrata runs exactly (see `read_shape`)
    rope_type: str = "default"  # transformers' name of its RoPE variant ("llama3", "dynamic", "yarn", ...)

    def kv_block_nbytes(self, block_size: int, dtype_name: str) -> int:
        """Bytes of one KV block: `[num_layers, 2, block_size, num_kv_heads, row]` elements of `dtype_name` (a
        torch dtype name), a row being head_dim values (and a scale for int8, kernels/kv_format.py)."""
        element_nbytes = DTYPE_NBYTES[dtype_name]
        row_nbytes = row_width(self.head_dim, dtype_name) * element_nbytes
        return self.num_layers * 2 * block_size * self.num_kv_heads * row_nbytes


# SmolLM2-135M-Instruct, as its GGUF describes it (checked against the loaded model in tests).
EMBEDDED_SHAPE = ModelShape(architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3,
                            head_dim=64, vocab_size=49152, max_model_len=8192)


def read_shape(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a transformers config (a `config.json`'s data); ValueError, one line, if
    kvstrata cannot run it.

    `max_model_len` is `max_position_embeddings`, capped at the sliding window where the model
    uses one: kvstrata's attention sees every earlier token, which equals sliding-window attention
    only while the sequence fits in the window.
    """
    architecture = _architecture(config)
    activation = config.get("hidden_act", "silu")
    if activation != "silu":  # engine/decoder.py runs SiLU-gated MLPs, as every supported family ships them
        raise ValueError(f"its MLP activation {activation!r} is not supported (kvstrata runs 'silu')")
    try:
        num_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
        shape = ModelShape(
            architecture=architecture,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            max_model_len=min(int(config["max_position_embeddings"]), _sliding_window(config) or math.inf),
            rope_type=_rope_type(config),
        )
    except KeyError as exc:
        raise ValueError(f"its config has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its config has a malformed field: {exc}") from None
    if min(shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size,
           shape.max_model_len) <= 0 or shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"its config gives an impossible shape: {shape}")
    return shape


# RoPE variants whose frequencies transformers recomputes at each forward pass from the longest position (read
# back to the host): a CUDA graph would replay the frequencies of the step it recorded.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_type(config: Mapping[str, Any]) -> str:
    """The RoPE variant, from the config's `rope_scaling` (or transformers 5's `rope_parameters`)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if isinstance(rope, Mapping):
            return str(rope.get("rope_type") or rope.get("type") or "default")
    return "default"


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):  # one name where transformers writes a list of them
        architectures = [architectures]
    model_type = config.get("model_type")
    if architectures:
        name = architectures[0]
        if name in SUPPORTED_ARCHITECTURES.values():
            return name
    elif model_type in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[model_type]
    else:
        name = f"model_type {model_type!r}" if model_type else "an unnamed architecture"
    raise ValueError(f"architecture {name} is not supported (supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES.values())})")


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """The attention window, if any layer attends to a window only (transformers' spellings)."""
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if "use_sliding_window" in config:  # Qwen2 and Qwen3 ship a window they do not use by default
        return int(window) if config["use_sliding_window"] else None
    return int(window)  # Mistral: a window set is a window used


def model_shape(name: str, load_format: str = "auto") -> ModelShape:
    """The shape of `model.name` (the embedded model, a preset, a model directory or a GGUF file) without loading
    it."""
    if load_format == "dummy" and name in PRESETS:
        return read_shape(PRESETS[name])
    if name == EMBEDDED_MODEL:
        return EMBEDDED_SHAPE
    if is_gguf_file(name):
        return read_shape(read_gguf_config(Path(name)))
    return read_shape(read_config_json(Path(name)))


def is_gguf_file(name: str) -> bool:
    """A path to a GGUF file (llama.cpp's format): a model kvstrata converts on its first start."""
    path = Path(name).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


# GGUF metadata (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): a header, then key-value pairs whose
# values are typed scalars, strings or arrays of them. Only the header's pairs are read, never the tensors.
GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_PAIRS = 1 << 16  # a header claiming more is damaged (real ones hold a few dozen)


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata: scalars and strings as values, arrays as their length (a vocabulary's 100k strings
    are skipped, not kept). ValueError, one line, for a file that is not a whole GGUF header."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file")
            version, _tensors, pairs = struct.unpack("<IQQ", _read(f, 20))
            if version < 2 or pairs > _GGUF_MAX_PAIRS:
                raise ValueError(f"{path}: GGUF version {version} with {pairs} metadata pairs is not readable")
            metadata = {}
            for _ in range(pairs):
                key = _read_gguf_string(f)
                (value_type,) = struct.unpack("<I", _read(f, 4))
                metadata[key] = _read_gguf_value(f, value_type)
            return metadata
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: damaged GGUF metadata ({exc})") from None


def _read(f, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{f.name}: the GGUF header ends early")
    return data


_GGUF_MAX_STRING = 1 << 24  # a longer string in a header is damage (the longest real ones are chat templates)


def _read_gguf_string(f) -> str:
    (length,) = struct.unpack("<Q", _read(f, 8))
    if length > _GGUF_MAX_STRING:
        raise ValueError(f"{f.name}: damaged GGUF metadata (a string of {length} bytes)")
    return _read(f, length).decode("utf-8")


def _read_gguf_value(f, value_type: int) -> Any:
    if value_type in _GGUF_SCALARS:
        form = _GGUF_SCALARS[value_type]
        return struct.unpack(form, _read(f, struct.calcsize(form)))[0]
    if value_type == _GGUF_STRING:
        return _read_gguf_string(f)
    if value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack("<IQ", _read(f, 12))
        if item_type in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item_type]), 1)
        else:
            for _ in range(count):
                _read_gguf_value(f, item_type)
        return count
    raise ValueError(f"{f.name}: unknown GGUF value type {value_type}")


def read_gguf_config(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata as the transformers config keys `read_shape` reads (transformers' own conversion
    maps the same keys when it loads the file)."""
    metadata = read_gguf_metadata(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: its GGUF metadata names no architecture")

    def of_arch(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    config = {"model_type": arch, "num_hidden_layers": of_arch("block_count"),
              "num_attention_heads": of_arch("attention.head_count"),
              "num_key_value_heads": of_arch("attention.head_count_kv"), "hidden_size": of_arch("embedding_length"),
              "head_dim": of_arch("attention.key_length"),
              "vocab_size": of_arch("vocab_size") or metadata.get("tokenizer.ggml.tokens"),
              "max_position_embeddings": of_arch("context_length"),
              "sliding_window": of_arch("attention.sliding_window")}
    rope_type = of_arch("rope.scaling.type")
    if rope_type not in (None, "none"):
        config["rope_scaling"] = {"rope_type": rope_type}
    return {key: value for key, value in config.items() if value is not None}


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config
