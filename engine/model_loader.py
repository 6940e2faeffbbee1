"""Load the model a `ModelSource` names (engine/model_source.py): the embedded SmolLM2 GGUF, a local Hugging Face
model directory, or a model with random weights built from a transformers config (`load_format: dummy`).

Nothing is ever fetched from a hub: a name is either the embedded model, a local path, or (dummy
only) a preset named in `model_spec.PRESETS`. The engine runs the loaded weights with its own forward
pass over the paged KV cache (`engine/decoder.py`), so a checkpoint it reads exactly is read without
transformers' model classes (`engine/checkpoint.py`); any other model is built by transformers, whose own
forward is left as transformers builds it, with SDPA attention (tests compare against it). Whatever goes
wrong while loading is one line naming `model.name` (a ValueError), never a traceback.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvstrata.engine.checkpoint import read_checkpoint
from kvstrata.engine.converted_model import converted_dir, first_line, load_or_convert
# resolve_model and EMBEDDED_MODEL are imported here for callers too: a model is found, then loaded
from kvstrata.engine.model_source import (EMBEDDED_MODEL, ModelSource, embedded_tokenizer, load_tokenizer,  # noqa: F401
                                          model_identity, resolve_model)
from kvstrata.engine.model_spec import PRESETS, read_config_json, read_shape

logger = logging.getLogger("kvstrata")

DUMMY_SEED = 0  # random weights are the same in every process for one config, dtype and device
TRANSFORMERS_ATTENTION = "sdpa"  # for transformers' own forward, which the engine never calls


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model, whatever format it came in."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # the model's own limit (capped at its sliding window, see model_spec.read_shape)
    eos_token_ids: frozenset[int]
    identity: str  # names the weights unambiguously; folded into the hash namespace (dtype is not in it)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # engine/checkpoint.py's CausalLM or transformers' *ForCausalLM; eval mode, no gradients
    tokenizer: object
    model_config: ModelConfig
    source: ModelSource

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str, *,
               transformers_modules: bool = False) -> LoadedModel:
    """Load tokenizer and weights (dequantised to `dtype` for a GGUF; random for `dummy`). Raises ValueError, one
    line naming `model.name`, for anything that fails.

    The weights of a checkpoint it reads exactly (engine/checkpoint.py) come in kvstrata's own weight modules,
    without importing transformers' model classes; any other model's, or with `transformers_modules`, in
    transformers' `*ForCausalLM`, whose own forward then runs too (tests and benchmarks compare against it). The
    engine runs either the same way, to the same bits."""
    # never reach a hub: the env var covers code paths that ignore local_files_only; it must be set
    # before huggingface_hub is first imported, which transformers does on import
    os.environ["HF_HUB_OFFLINE"] = "1"
    if source.load_format == "dummy":
        return build_dummy_model(source, dtype, device)
    if not source.gguf_file:
        _check_runnable(source)  # before reading gigabytes of weights
    try:
        with _gguf_parsed_once():
            tokenizer, model = _from_pretrained(source, dtype, transformers_modules)
        model.to(device).eval().requires_grad_(False)
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as exc:
        raise ValueError(f"model.name: cannot load {source.directory}: {first_line(exc)}") from None
    return LoadedModel(model, tokenizer, _summarise(model, tokenizer, model_identity(source)), source)


def _from_pretrained(source: ModelSource, dtype: torch.dtype, transformers_modules: bool):
    def from_files(directory: Path, **files):
        if not files and not transformers_modules:
            model = read_checkpoint(directory, dtype)
            if model is not None:
                return model
        from transformers import AutoModelForCausalLM

        with _quiet_gguf_dtype_warning():
            return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True,
                                                        attn_implementation=TRANSFORMERS_ATTENTION, **files)

    tokenizer = load_tokenizer(source)
    if not source.gguf_file:
        return tokenizer, from_files(source.directory)
    # the GGUF's weights in this dtype, converted once and kept (engine/converted_model.py)
    # (in kvstrata's own modules, read back from the copy on a first start too, unless transformers' are asked for)
    model = load_or_convert(converted_dir(model_identity(source)) / str(dtype).removeprefix("torch."), from_files,
                            lambda: from_files(source.directory, gguf_file=source.gguf_file), _save_dequantised,
                            read_back=not transformers_modules)
    return tokenizer, model


def _save_dequantised(model: torch.nn.Module, folder: Path) -> None:
    """A model loaded from a GGUF (its weights dequantised), saved as a plain one: transformers refuses to save a
    model it marks quantised, though it holds none but dense weights (checked in tests), so its config is written
    without the GGUF mark and its weights as safetensors (tied ones once)."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


def build_dummy_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """A model of the source's architecture and shape with random weights (seed `DUMMY_SEED`) and the
    embedded model's tokenizer, so that figures for realistic model sizes need no downloaded weights.

    The model is built directly on `device` in `dtype` (an 8B-shaped model takes its 16 GB of
    bfloat16 once, on the GPU, never twice on the host). The vocabulary is set to the tokenizer's
    (49,152 tokens; Llama 3's 128,256 would give ids the tokenizer cannot decode), so the
    embedding and output layer are smaller than the preset's; every other layer is as configured.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = _check_runnable(source)
    tokenizer = embedded_tokenizer()
    if hf_config.get("vocab_size") != len(tokenizer):
        logger.warning("model.name: %s: random weights with the embedded tokenizer's vocabulary of %d tokens "
                       "(the config says %s)", source.display_name, len(tokenizer), hf_config.get("vocab_size"))
        hf_config["vocab_size"] = len(tokenizer)
    try:
        config = AutoConfig.for_model(**hf_config)
        devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(DUMMY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=TRANSFORMERS_ATTENTION)
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ValueError(f"model.name: cannot build {source.display_name}: {first_line(exc)}") from None
    model.eval().requires_grad_(False)
    # The namespace differs from every real model's (theirs end in "@xxh3_128:<weights digest>"), and
    # with the device: the same seed draws other weights on a GPU than on a CPU.
    config_digest = xxhash.xxh3_128(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()
    identity = f"{source.display_name}@dummy-seed{DUMMY_SEED}-{torch.device(device).type}:{config_digest}"
    return LoadedModel(model, tokenizer, _summarise(model, tokenizer, identity), source)


def _check_runnable(source: ModelSource) -> dict:
    """The source's transformers config (a preset's or its config.json's), if kvstrata runs it."""
    try:
        hf_config = dict(PRESETS[source.display_name]) if source.directory is None \
            else read_config_json(source.directory)
        read_shape(hf_config)
    except ValueError as exc:
        raise ValueError(f"model.name: {source.display_name}: {exc}") from None
    return hf_config


@contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF's header three times in one load (for the config, the tokenizer and the
    weights), and each parse walks the tokenizer's ~100k strings one numpy slice at a time; it also builds the
    table of GGUF tensor names anew for each of the model's ~400 modules. Each is a large part of a first start.
    While loading, the `gguf` package's reader is built once per file and its name table once per architecture,
    and shared: transformers only reads them."""
    try:
        import gguf
    except ImportError:  # a model directory needs no GGUF reader; a GGUF without it fails with transformers' line
        yield
        return
    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    shared_reader = _built_once(make_reader, lambda path, mode="r": (os.fspath(path), mode))
    shared_name_map = _built_once(make_name_map, lambda arch, n_blocks: (arch, n_blocks))
    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, shared_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map


def _built_once(build, key):
    """`build`, called through once per `key(*args, **kwargs)`, answering again with what it built then."""
    built: dict = {}

    def shared(*args, **kwargs):
        k = key(*args, **kwargs)
        if k not in built:
            built[k] = build(*args, **kwargs)
        return built[k]
    return shared


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


def _summarise(model: torch.nn.Module, tokenizer, identity: str) -> ModelConfig:
    shape = read_shape(model.config.to_dict())
    return ModelConfig(
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_model_len,
        eos_token_ids=_eos_token_ids(tokenizer, model.generation_config),
        identity=identity,
    )


def _eos_token_ids(tokenizer, generation_config) -> frozenset[int]:
    ids: set[int] = set()
    for eos in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(eos)
    return frozenset(ids)
