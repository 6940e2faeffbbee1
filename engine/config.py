"""The engine's configuration: YAML in, typed frozen objects out (DESIGN.md, "YAML").

    model:  {name: smollm2-135m-instruct, dtype: bfloat16, device: auto, attention_backend: auto, max_model_len: null}
    cache:
      enable_prefix_caching: true
      block_size: 16
      hash: xxh3_128            # or sha256
      tiers:
        device: {size: 1GiB}
        cpu:    {size: 4GiB, pinned: true}
        disk:   {path: ./kvstore, size: 32GiB}
      offload: write_through    # or on_evict
    scheduler: {max_num_batched_tokens: 2048, max_num_seqs: 32}
    server: {host: 127.0.0.1, port: 8000, model_alias: null}

The config is validated once, here, at the edge; inside the engine the types are trusted. Every
problem becomes one `ConfigError` whose message is a single line naming the dotted key
(`cache.tiers.dsk: unknown key`). Validation also checks the config against the machine: the disk
path must be writable (its directory is created), and byte sizes must fit in the memory or disk that
would hold them.

Invariants of a `Config`: the device tier is on; `cache.tiers.cpu` / `cache.tiers.disk` are None
exactly when that tier is off (left out, null, or sized 0); paths (the disk tier's, a model
directory) are absolute, relative ones having been resolved against the current directory at load
time; dtype and device are spelled canonically (`bfloat16`, `cuda:0`).

This module must stay cheap to import: `kvstrata config check` uses it without torch.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, PlainValidator,
                      ValidationError, field_validator, model_validator)

from kvstrata.engine.sizes import Size, format_bytes, format_size

EMBEDDED_MODEL = "smollm2-135m-instruct"
DEFAULT_DEVICE_TIER_SIZE = Size(nbytes=1024**3)

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Environment overrides: (variable, dotted key, parse the value as a YAML scalar?). Applied in this
# order, so KVSTRATA_PORT wins over PORT. Strings such as paths are taken verbatim.
ENV_OVERRIDES = (
    ("PORT", "server.port", True),
    ("KVSTRATA_PORT", "server.port", True),
    ("KVSTRATA_HOST", "server.host", False),
    ("KVSTRATA_MODEL", "model.name", False),
    ("KVSTRATA_DTYPE", "model.dtype", False),
    ("KVSTRATA_DEVICE", "model.device", False),
    ("KVSTRATA_DEVICE_SIZE", "cache.tiers.device.size", True),
    ("KVSTRATA_CPU_SIZE", "cache.tiers.cpu.size", True),
    ("KVSTRATA_DISK_SIZE", "cache.tiers.disk.size", True),
    ("KVSTRATA_DISK_PATH", "cache.tiers.disk.path", False),
)


class ConfigError(ValueError):
    """A problem with a config, as one line: `<dotted.key>: <what is wrong>`.

    `key` is the dotted key at fault, or None when the problem is the file itself (missing,
    malformed YAML), in which case the message names the file.
    """

    def __init__(self, key: str | None, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class _FieldError(ValueError):
    """Raised inside validators to blame a key below the model being validated (e.g. `path`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# Field types


def _canonical_dtype(value: Any) -> Any:
    if isinstance(value, str):
        value = value.strip().lower()
        return _DTYPE_ALIASES.get(value, value)
    return value


def _size_value(size: Size) -> int | str:
    return size.to_yaml_value()


Dtype = Annotated[Literal["float32", "bfloat16", "float16"], BeforeValidator(_canonical_dtype)]
SizeField = Annotated[Size, PlainValidator(Size.parse), PlainSerializer(_size_value)]
PositiveInt = Annotated[int, Field(gt=0)]


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "16" for an int is the user's mistake, not ours to guess.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# ---------------------------------------------------------------------------------------------
# Sections


class ModelConfig(_Section):
    name: str = EMBEDDED_MODEL
    dtype: Dtype = "bfloat16"
    device: str = "auto"
    attention_backend: Literal["auto", "triton", "torch"] = "auto"
    max_model_len: PositiveInt | None = None  # None: the model's own limit

    @field_validator("name")
    @classmethod
    def _embedded_or_local_directory(cls, name: str) -> str:
        if name.strip().lower() == EMBEDDED_MODEL:
            return EMBEDDED_MODEL
        directory = Path(name).expanduser()
        if directory.is_dir() and (directory / "config.json").is_file():
            return os.path.abspath(directory)
        raise ValueError(f"{name!r} is neither the embedded model {EMBEDDED_MODEL!r} "
                         "nor a local model directory with a config.json")

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        canonical = device.strip().lower()
        if not _DEVICE_RE.match(canonical):
            raise ValueError(f"unknown device {device!r} (expected auto, cpu, cuda or cuda:N)")
        return canonical

    @property
    def is_embedded(self) -> bool:
        return self.name == EMBEDDED_MODEL

    @property
    def torch_dtype(self):
        """The dtype as a `torch.dtype` (imports torch, so only the engine calls it)."""
        import torch
        return getattr(torch, self.dtype)


class DeviceTierConfig(_Section):
    size: SizeField = DEFAULT_DEVICE_TIER_SIZE

    @field_validator("size")
    @classmethod
    def _on(cls, size: Size) -> Size:
        if size.is_off:
            raise ValueError("the device tier cannot be off; give it a size such as 1GiB or a block count")
        return size


class CpuTierConfig(_Section):
    size: SizeField
    pinned: bool = True  # page-locked host memory for fast copies to a GPU; ignored without CUDA

    @model_validator(mode="after")
    def _fits_in_ram(self) -> CpuTierConfig:
        ram = _ram_bytes()
        if self.size.is_bytes and self.size.nbytes > ram:
            raise _FieldError("size", f"{format_size(self.size.nbytes)} is more than this machine's RAM "
                                      f"({format_bytes(ram)})")
        return self


class DiskTierConfig(_Section):
    # Relative paths resolve against the current directory when the config is loaded.
    path: Path = Field(default="./kvstore", validate_default=True)
    size: SizeField

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, path: Any) -> Path:
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise ValueError(f"expected a directory path, got {_short_repr(path)}")
        return Path(os.path.abspath(Path(path).expanduser()))

    @model_validator(mode="after")
    def _writable_and_fits(self) -> DiskTierConfig:
        if self.size.is_off:
            return self  # an off tier touches nothing
        _check_writable_directory(self.path)
        if self.size.is_bytes:
            room = _disk_room_bytes(self.path)
            if self.size.nbytes > room:
                raise _FieldError("size", f"{format_size(self.size.nbytes)} is more than the free space at "
                                          f"{str(self.path)!r} ({format_bytes(room)})")
        return self


class TiersConfig(_Section):
    device: DeviceTierConfig = DeviceTierConfig()
    cpu: CpuTierConfig | None = None   # None: off
    disk: DiskTierConfig | None = None  # None: off

    @field_validator("device", mode="before")
    @classmethod
    def _device_is_on(cls, device: Any) -> Any:
        if device is None:
            raise ValueError("the device tier cannot be off; give it a size such as 1GiB or a block count")
        return device

    @field_validator("cpu", "disk")
    @classmethod
    def _zero_is_off(cls, tier: CpuTierConfig | DiskTierConfig | None):
        return None if tier is not None and tier.size.is_off else tier


class CacheConfig(_Section):
    enable_prefix_caching: bool = True
    block_size: Literal[8, 16, 32, 64] = 16
    hash: Literal["xxh3_128", "sha256"] = "xxh3_128"
    tiers: TiersConfig = TiersConfig()
    offload: Literal["write_through", "on_evict"] = "write_through"

    @field_validator("tiers", mode="before")
    @classmethod
    def _empty_is_default(cls, section: Any) -> Any:
        return {} if section is None else section


class SchedulerConfig(_Section):
    max_num_batched_tokens: PositiveInt = 2048
    max_num_seqs: PositiveInt = 32


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port
    model_alias: str | None = None  # the model id served by /v1/models; None: model.name


class Config(_Section):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()

    @field_validator("model", "cache", "scheduler", "server", mode="before")
    @classmethod
    def _empty_is_default(cls, section: Any) -> Any:
        # `server:` with every key commented out is YAML null: it means "the defaults", not "off".
        return {} if section is None else section

    @model_validator(mode="after")
    def _device_tier_fits(self) -> Config:
        size = self.cache.tiers.device.size
        if not size.is_bytes:
            return self  # a block count's bytes depend on the model: checked when the pool is allocated
        where, capacity = _device_capacity(self.model.device)
        if capacity is not None and size.nbytes > capacity:
            raise _FieldError("cache.tiers.device.size",
                              f"{format_size(size.nbytes)} is more than {where} ({format_bytes(capacity)})")
        return self

    def tiers_enabled(self) -> tuple[str, ...]:
        """The tiers that are on, top down: always "device", then "cpu" and "disk" if configured."""
        tiers = self.cache.tiers
        return ("device",) + (("cpu",) if tiers.cpu else ()) + (("disk",) if tiers.disk else ())

    def resolved_device(self) -> str:
        """`model.device` with `auto` resolved: "cuda" when torch sees a CUDA device, else "cpu"."""
        if self.model.device != "auto":
            return self.model.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able data; `load_config(config.to_dict())` gives an equal Config."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(source: str | os.PathLike | Mapping | Config | None = None,
                overrides: Mapping[str, Any] | list[str] | str | None = None) -> Config:
    """Load and validate a config.

    `source`: a YAML file path, a dict shaped like the YAML, an existing Config, or None (the
    built-in defaults: the embedded model and a 1GiB device tier, no lower tiers).
    `overrides`: `{"dotted.key": value}` or `["dotted.key=value", ...]` (values parsed as YAML
    scalars; `key=null` removes a lower tier). Precedence: source < environment (see
    `ENV_OVERRIDES`; not re-applied to an existing Config) < overrides.
    Raises ConfigError, one line naming the key, for any problem.
    """
    env_sources: dict[str, str] = {}
    if isinstance(source, Config):
        raw = source.to_dict()
    else:
        raw = _read_source(source)
        for variable, key, value in _environment_overrides(os.environ):
            _set_dotted(raw, key, value)
            env_sources[key] = variable
    for key, value in parse_overrides(overrides).items():
        _set_dotted(raw, key, value)
        env_sources.pop(key, None)
    return _validate(raw, env_sources)


def _read_source(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        return _read_yaml_file(Path(source))
    raise ConfigError(None, f"a config source must be a YAML path, a dict or a Config, not {type(source).__name__}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(None, f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(None, f"{path}: is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(None, f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(None, f"{path}: malformed YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(None, f"{path}: malformed YAML: {_one_line(str(exc))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(None, f"{path}: expected a mapping of sections (model, cache, scheduler, server), "
                                f"got {type(data).__name__}")
    return data


def _environment_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, Any]]:
    """(variable, dotted key, value) for each set, non-empty override variable, in precedence order."""
    found = []
    for variable, key, as_yaml in ENV_OVERRIDES:
        text = environ.get(variable, "").strip()
        if text:
            value = _parse_scalar(f"{key} (from ${variable})", text) if as_yaml else text
            found.append((variable, key, value))
    return found


def parse_overrides(overrides: Mapping[str, Any] | list[str] | str | None) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}` (values parsed as YAML scalars); a dict passes through."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    if isinstance(overrides, str):
        overrides = [overrides]
    parsed = {}
    for item in overrides:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            raise ConfigError(str(item), "an override must look like dotted.key=value")
        parsed[key.strip()] = _parse_scalar(key.strip(), text.strip())
    return parsed


def _parse_scalar(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {text!r}: {_one_line(str(exc))}") from None


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `raw[a][b][c] = value` for key "a.b.c", creating mappings on the way; mappings merge."""
    parts = key.split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(key, "malformed dotted key")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(".".join(parts[:depth + 1]), f"is not a mapping, so {key} cannot be set")
        node = child
    last = parts[-1]
    if isinstance(value, Mapping) and isinstance(node.get(last), dict):
        for sub_key, sub_value in value.items():
            _set_dotted(node[last], str(sub_key), sub_value)
    else:
        node[last] = copy.deepcopy(value)


def _validate(raw: dict[str, Any], env_sources: Mapping[str, str]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise _translate(exc, env_sources) from None


# ---------------------------------------------------------------------------------------------
# One-line errors out of pydantic's


def _translate(exc: ValidationError, env_sources: Mapping[str, str]) -> ConfigError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):
        loc += cause.field.split(".")
        message = cause.message
    else:
        message = _describe(first)
    key = ".".join(loc) or "config"
    for env_key, variable in env_sources.items():
        if key == env_key or key.startswith(env_key + "."):
            message += f" (from ${variable})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ConfigError(key, _one_line(message))


def _describe(error: dict[str, Any]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    got = _short_repr(value)
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "missing (required here)"
    if kind == "literal_error":
        return f"unknown value {got} (expected {ctx.get('expected')})"
    if kind.startswith("int_"):
        return f"expected an integer, got {got}"
    if kind.startswith("bool_"):
        return f"expected true or false, got {got}"
    if kind.startswith("string_"):
        return f"expected a string, got {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping, got {got}"
    if kind == "greater_than":
        return f"must be positive, got {got}" if ctx.get("gt") == 0 else f"must be greater than {ctx.get('gt')}, got {got}"
    if kind == "greater_than_equal":
        return f"must be at least {ctx.get('ge')}, got {got}"
    if kind == "less_than_equal":
        return f"must be at most {ctx.get('le')}, got {got}"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return error["msg"]


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# What the machine can hold


def _ram_bytes() -> int:
    return psutil.virtual_memory().total


def _device_capacity(device: str) -> tuple[str, int | None]:
    """Where the device tier would live and how many bytes that memory holds (None: unknown)."""
    if device == "cpu":
        return "this machine's RAM", _ram_bytes()
    index = int(device.partition(":")[2] or 0)
    gpu_bytes = _gpu_memory_bytes(index)
    if device == "auto" and gpu_bytes is None:
        return "this machine's RAM", _ram_bytes()
    return f"the memory of cuda:{index}", gpu_bytes


def _gpu_memory_bytes(index: int) -> int | None:
    """Total memory of CUDA device `index`, or None when no CUDA device can be seen.

    Asks torch only when it is already imported (the engine); otherwise asks nvidia-smi, so that
    validating a config stays cheap.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return None
        return torch.cuda.get_device_properties(index).total_memory
    return _nvidia_smi_memory_bytes(index)


def _nvidia_smi_memory_bytes(index: int) -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = str(index)
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        if index >= len(ids):
            return None
        physical = ids[index]
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                              "-i", physical], capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.strip().splitlines()[0]) * 1024**2  # reported in MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _check_writable_directory(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise _FieldError("path", f"{str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvstrata-write-test-"):
            pass
    except OSError as exc:
        raise _FieldError("path", f"cannot write to {str(path)!r}: {exc.strerror or exc}") from None


def _disk_room_bytes(path: Path) -> int:
    """Free bytes on the path's filesystem plus what the files already there (an old store) occupy."""
    occupied = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            occupied += entry.stat(follow_symlinks=False).st_blocks * 512
    return shutil.disk_usage(path).free + occupied
