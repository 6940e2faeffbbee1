"""The engine's configuration: YAML in, typed frozen objects out (DESIGN.md, "YAML").

    model:  {name: smollm2-135m-instruct, load_format: auto, dtype: auto, device: auto, attention_backend: auto,
             max_model_len: null, threads: auto, batch_invariant: false, cuda_graphs: false}
    cache:
      enable_prefix_caching: true
      block_size: 16
      hash: xxh3_128            # or sha256
      tiers:
        device: {size: 1GiB}
        cpu:    {size: 4GiB, pinned: true}
        disk:   {path: ./kvstore, size: 32GiB}
        remote: {url: "redis://127.0.0.1:6379/0", cluster: false, key_prefix: kvstrata, timeout: 50ms, ttl: 0,
                 queue_size: 1GiB}
      offload: write_through    # or on_evict
      pin_share: 0.5            # the most of the CPU and disk tiers that pinned documents may take
      preload: [{file: handbook.txt, cache_salt: null, pin: true}]   # documents cached at start-up
      load_policy: auto         # or always_load, always_recompute
    scheduler: {max_num_batched_tokens: 2048, max_num_seqs: 32}
    server: {host: 127.0.0.1, port: 8000, model_alias: null, api_key: null, max_request_body: 32MiB}
    events: {endpoint: "tcp://127.0.0.1:5557", replay_endpoint: null, replay_buffer: 10000,
             queue_size: 100000, topic: ""}     # KV events; off when left out
    router: {host: 127.0.0.1, port: 8080, health_interval: 1s, request_timeout: 600s,
             replicas: [{url: "http://127.0.0.1:8001", events: "tcp://127.0.0.1:5557", replay: null}]}

The config is validated once, here, at the edge; inside the engine the types are trusted. Every
problem becomes one `ConfigError` whose message is a single line naming the dotted key
(`cache.tiers.dsk: unknown key`). Validation also checks the config against the model and the
machine, so that `kvstrata config check` refuses what `serve` would fail on: the model must be one
kvstrata runs (its shape is read from its config.json, not its weights), `max_model_len` within its
limit, a CUDA device must exist, the disk path must be writable (its directory is created, private
to its owner), and every tier size, in bytes or in blocks, must fit in the memory or disk that would hold it.

Invariants of a `Config`: the device tier is on; `cache.tiers.cpu` / `cache.tiers.disk` are None
exactly when that tier is off (left out, null, or sized 0), `cache.tiers.remote` when it is left out
or null; paths (the disk tier's, a model
directory) are absolute, relative ones having been resolved against the current directory at load
time; dtype and device are spelled canonically (`bfloat16`, `cuda:0`). `auto` values stay `auto` in
the config (it describes what was asked); `resolved_device()`, `resolved_dtype()` and
`resolved_threads()` say what they mean on this machine.

This module must stay cheap to import: `kvstrata config check` uses it without torch.
"""
from __future__ import annotations

import copy
import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, PlainValidator,
                      ValidationError, ValidationInfo, field_validator, model_validator)

from kvstrata.engine.model_spec import EMBEDDED_MODEL, LENGTH_DEPENDENT_ROPE, PRESETS, ModelShape, model_shape
from kvstrata.engine.sizes import Size, format_size
from kvstrata.tiers.remote_url import DEFAULT_QUEUE_BYTES, SECRET_MASK, check_url, masked_url
from kvstrata.tiers.storage import check_room, format_bytes, prepare_private_dir

DEFAULT_DEVICE_TIER_SIZE = Size(nbytes=1024**3)
# `cache.kv_cache_dtype` (vLLM's names) -> the torch dtype the K/V are kept in; auto: the model's dtype
# (int8: llama.cpp's q8_0 idea, rows scaled one by one, see kernels/kv_format.py)
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8",
                   "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
# `model.threads: auto` never picks more: past this, one request's matmuls gain little from more
# threads and a busy machine's scheduling noise grows (see `default_threads`).
MAX_AUTO_THREADS = 16
DEFAULT_MAX_REQUEST_BODY = 32 * 1024**2  # a 2k-token document is ~10 KB of JSON; a 128k-token one ~0.6 MB

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

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
    ("KVSTRATA_API_KEY", "server.api_key", False),
    ("KVSTRATA_REMOTE_URL", "cache.tiers.remote.url", False),
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


Dtype = Annotated[Literal["auto", "float32", "bfloat16", "float16"], BeforeValidator(_canonical_dtype)]
KVCacheDtype = Annotated[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "bfloat16", "float16", "float32"],
                         BeforeValidator(_canonical_dtype)]
SizeField = Annotated[Size, PlainValidator(Size.parse), PlainSerializer(_size_value)]
# A lower tier's processes that read promoted blocks; 0 reads them in the engine's process. Left out: as many as
# the transfer engine's fill threads.
ReadProcesses = Annotated[int | None, Field(ge=0, le=64)]
PositiveInt = Annotated[int, Field(gt=0)]


def _threads(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a positive integer or auto, got {_short_repr(value)}")
    if value <= 0:
        raise ValueError(f"must be positive (or auto), got {value}")
    return value


Threads = Annotated[int | str, PlainValidator(_threads)]

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: Any, allow_zero: bool) -> float:
    """A duration: "50ms", "0.2s", "10m", "1h", or a number of seconds."""
    text = str(value).strip().lower() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?", text)
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"] if match else -1.0
    if seconds < 0 or (seconds == 0 and not allow_zero):
        kind = "a duration" if allow_zero else "a positive duration"
        raise ValueError(f"expected {kind} such as 50ms or 0.2s, got {_short_repr(value)}")
    return seconds


def _duration_text(seconds: float) -> str:
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


# Seconds, written "50ms", "0.2s", "1h" or as a number; printed back in the same form.
Duration = Annotated[float, BeforeValidator(lambda value: _seconds(value, allow_zero=False)),
                     PlainSerializer(_duration_text)]
DurationOrZero = Annotated[float, BeforeValidator(lambda value: _seconds(value, allow_zero=True)),
                           PlainSerializer(_duration_text)]


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"expected a fraction in (0, 1], got {_short_repr(value)}")
    return float(value)


Fraction = Annotated[float, PlainValidator(_fraction)]


class _Section(BaseModel):
    # strict: YAML already gives typed values, so "16" for an int is the user's mistake, not ours to guess.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# ---------------------------------------------------------------------------------------------
# Sections


class ModelConfig(_Section):
    name: str = EMBEDDED_MODEL
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights from the model's config
    dtype: Dtype = "auto"
    device: str = "auto"
    attention_backend: Literal["auto", "triton", "torch"] = "auto"
    max_model_len: PositiveInt | None = None  # None: the model's own limit
    threads: Threads = "auto"  # torch's CPU threads; auto: see `default_threads`
    # Reductions in an order no batch or chunking changes: cached and uncached outputs then agree bit for bit in
    # every dtype, at a cost (benchmarks/results/batch_invariance.md). Its K/V get their own hash namespace.
    batch_invariant: bool = False
    # Steps of few tokens (decodes, questions) replayed as CUDA graphs (engine/cuda_graphs.py) on a CUDA device;
    # ignored on a CPU with device auto. On in configs/gpu.yaml; off by default here, where the CPU is the default.
    cuda_graphs: bool = False

    @field_validator("name")
    @classmethod
    def _canonical_name(cls, name: str) -> str:
        if name.strip().lower() == EMBEDDED_MODEL:
            return EMBEDDED_MODEL
        directory = Path(name).expanduser()
        return os.path.abspath(directory) if directory.is_dir() else name.strip()

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        canonical = device.strip().lower()
        if not _DEVICE_RE.match(canonical):
            raise ValueError(f"unknown device {device!r} (expected auto, cpu, cuda or cuda:N)")
        if canonical.startswith("cuda"):
            index = int(canonical.partition(":")[2] or 0)
            if _gpu_memory_bytes(index, explicit=True) is None:
                raise ValueError(f"{canonical}: no such CUDA device on this machine "
                                 f"({_describe_cuda_devices()}; use cpu or auto)")
        return canonical

    @model_validator(mode="after")
    def _runnable_model(self) -> ModelConfig:
        if self.cuda_graphs and self.device == "cpu":
            raise _FieldError("cuda_graphs", "CUDA graphs need a CUDA device, and model.device is cpu "
                                             "(use device auto or cuda, or turn cuda_graphs off)")
        shape = self.shape()
        if self.cuda_graphs and shape.rope_type in LENGTH_DEPENDENT_ROPE:
            raise _FieldError("cuda_graphs", f"the model's RoPE ({shape.rope_type!r}) changes its frequencies with "
                                             "the sequence's length, which a recorded graph cannot follow "
                                             "(turn cuda_graphs off)")
        if self.max_model_len is not None and self.max_model_len > shape.max_model_len:
            raise _FieldError("max_model_len", f"{self.max_model_len} is more than the model's limit of "
                                               f"{shape.max_model_len} tokens")
        return self

    def shape(self) -> ModelShape:
        """The model's architecture and KV shape, read from its config (no weights are loaded)."""
        if self.load_format == "dummy" and self.name in PRESETS:
            return model_shape(self.name, self.load_format)
        if self.name != EMBEDDED_MODEL and not (Path(self.name) / "config.json").is_file():
            presets = f", or with load_format: dummy a preset ({', '.join(PRESETS)})"
            raise _FieldError("name", f"{self.name!r} is neither the embedded model {EMBEDDED_MODEL!r} nor a "
                                      f"local model directory with a config.json{presets}")
        if self.name == EMBEDDED_MODEL and self.load_format == "dummy":
            raise _FieldError("load_format", f"dummy needs a model config: a preset ({', '.join(PRESETS)}) "
                                             "or a model directory")
        try:
            return model_shape(self.name, self.load_format)
        except ValueError as exc:
            raise _FieldError("name", f"{self.name}: {exc}") from None

    @property
    def is_embedded(self) -> bool:
        return self.name == EMBEDDED_MODEL


def _some_size(size: Size, refusal: str) -> Size:
    """`size`, unless it is zero (which turns a tier off), where some size is needed."""
    if size.is_off:
        raise ValueError(f"{refusal}; give it a size such as 1GiB or a block count")
    return size


class DeviceTierConfig(_Section):
    size: SizeField = DEFAULT_DEVICE_TIER_SIZE

    @field_validator("size")
    @classmethod
    def _on(cls, size: Size) -> Size:
        return _some_size(size, "the device tier cannot be off")


class CpuTierConfig(_Section):
    size: SizeField
    pinned: bool = True  # page-locked host memory for fast copies to a GPU; ignored without CUDA


class DiskTierConfig(_Section):
    # Relative paths resolve against the current directory when the config is loaded.
    path: Path = Field(default="./kvstore", validate_default=True)
    size: SizeField
    read_processes: ReadProcesses = None  # tiers/disk_reader.py

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, path: Any) -> Path:
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise ValueError(f"expected a directory path, got {_short_repr(path)}")
        return Path(os.path.abspath(Path(path).expanduser()))

    @model_validator(mode="after")
    def _writable(self, info: ValidationInfo) -> DiskTierConfig:
        # An off tier touches nothing; a command that only reads the store neither creates nor writes it.
        if not self.size.is_off and not _disk_read_only(info):
            try:
                prepare_private_dir(self.path)  # created 0700: stored token ids decode back to prompts
            except ValueError as exc:
                raise _FieldError("path", str(exc)) from None
        return self


def _remote_url(value: Any) -> Any:
    # Never echo a value here: a URL carries the password.
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a URL such as redis://127.0.0.1:6379/0")
    return value.strip()


class RemoteTierConfig(_Section):
    """A Valkey or Redis server (or cluster) shared by replicas; its own eviction (`maxmemory`,
    `allkeys-lru`) bounds it, so it has no size here. `ttl` 0: blocks never expire."""

    url: Annotated[str, BeforeValidator(_remote_url)] = Field(repr=False)  # may carry a password: masked when shown
    cluster: bool = False
    key_prefix: str = "kvstrata"
    timeout: Duration = 0.05
    ttl: DurationOrZero = 0.0
    # Records waiting to be written (bytes, or blocks): a burst beyond it is dropped, and counted.
    queue_size: SizeField = Size(nbytes=DEFAULT_QUEUE_BYTES)
    read_processes: ReadProcesses = None  # tiers/remote_reader.py

    @field_validator("queue_size")
    @classmethod
    def _some_queue(cls, size: Size) -> Size:
        return _some_size(size, "the write queue cannot be empty")

    @field_validator("key_prefix")
    @classmethod
    def _plain_prefix(cls, prefix: str) -> str:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"expected a non-empty prefix without spaces, got {_short_repr(prefix)}")
        return prefix

    @model_validator(mode="after")
    def _usable_url(self) -> RemoteTierConfig:
        try:
            check_url(self.url, self.cluster)
        except ValueError as exc:
            raise _FieldError("url", str(exc)) from None
        if importlib.util.find_spec("redis") is None:
            raise ValueError("the remote tier needs the redis client: pip install 'kvstrata[remote]'")
        return self

    def __repr__(self) -> str:
        return f"RemoteTierConfig(url={masked_url(self.url)!r}, cluster={self.cluster}, key_prefix={self.key_prefix!r})"


class TiersConfig(_Section):
    device: DeviceTierConfig = DeviceTierConfig()
    cpu: CpuTierConfig | None = None   # None: off
    disk: DiskTierConfig | None = None  # None: off
    remote: RemoteTierConfig | None = None  # None: off

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


class PreloadConfig(_Section):
    """A document cached at start-up: a UTF-8 text file, rendered as `kvstrata ask` renders its
    document (so its questions find it cached), under `cache_salt`, pinned if `pin`."""

    file: Path
    cache_salt: str | None = None
    pin: bool = True

    @field_validator("file", mode="before")
    @classmethod
    def _readable_file(cls, path: Any) -> Path:
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise ValueError(f"expected a file path, got {_short_repr(path)}")
        path = Path(os.path.abspath(Path(path).expanduser()))
        if not path.is_file():
            raise ValueError(f"no such file {str(path)!r}")
        if not os.access(path, os.R_OK):
            raise ValueError(f"cannot read {str(path)!r}")
        return path


class CacheConfig(_Section):
    enable_prefix_caching: bool = True
    block_size: Literal[8, 16, 32, 64] = 16
    hash: Literal["xxh3_128", "sha256"] = "xxh3_128"
    tiers: TiersConfig = TiersConfig()
    offload: Literal["write_through", "on_evict"] = "write_through"
    pin_share: Fraction = 0.5
    preload: tuple[PreloadConfig, ...] = ()
    # whether a prefix found below the device is loaded or recomputed (engine/load_policy.py)
    load_policy: Literal["auto", "always_load", "always_recompute"] = "auto"
    # what the K/V are kept in, on the device and in every tier: auto is the model's dtype; fp8 (e4m3)
    # halves a bf16 block and quarters a float32 one; int8 (scaled rows) nearly so, losing less
    # (README, "KV cache dtype")
    kv_cache_dtype: KVCacheDtype = "auto"

    @field_validator("tiers", mode="before")
    @classmethod
    def _empty_is_default(cls, section: Any) -> Any:
        return {} if section is None else section

    @field_validator("preload", mode="before")
    @classmethod
    def _list(cls, entries: Any) -> Any:
        if entries is None:
            return ()
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"expected a list of {{file, cache_salt, pin}}, got {_short_repr(entries)}")
        return tuple(entries)

    @model_validator(mode="after")
    def _preload_needs_caching(self) -> CacheConfig:
        if self.preload and not self.enable_prefix_caching:
            raise _FieldError("preload", "needs cache.enable_prefix_caching: true")
        return self


class SchedulerConfig(_Section):
    """How requests share the engine's steps (README, "Scheduling under concurrency").

    `policy`: `uncached_first` admits waiting requests by the work left after the cache lookup,
    short first, with aging; `fcfs` in arrival order. Under `uncached_first`, while a first token is at
    stake a step computes at most what `step_target` (seconds; YAML takes "50ms" or "0.2s") allows at
    the engine's measured prefill speed, of which the long prefills get at most `long_prefill_share`
    while short work waits, and while requests arrive during steps it keeps to `step_target` too;
    otherwise a step lasts at most 8 step targets.
    """

    max_num_batched_tokens: PositiveInt = 2048
    max_num_seqs: PositiveInt = 32
    policy: Literal["fcfs", "uncached_first"] = "uncached_first"
    step_target: Duration = 0.25
    long_prefill_share: Fraction = 0.25


def _request_body_limit(value: Any) -> int:
    """A byte size: "32MiB", "1.5MB", or a plain number of bytes (not blocks: nothing here is a block)."""
    try:
        size = Size.parse(value)
    except ValueError:
        raise ValueError(f"expected a byte size such as '32MiB' or a number of bytes, got {_short_repr(value)}") from None
    nbytes = size.nbytes if size.is_bytes else size.num_blocks
    if nbytes < 1:
        raise ValueError(f"must be at least one byte, got {value!r}")
    return nbytes


def _api_key(value: Any) -> Any:
    # Never echo the value: a key mistyped as a number is still a secret.
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError("expected a non-empty string (leave it out, or null, for no key)")
    return value


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port
    model_alias: str | None = None  # the model id served by /v1/models; None: model.name
    # Clients must send `Authorization: Bearer <api_key>` to /v1/*; None: no key. Masked when printed.
    api_key: Annotated[str | None, BeforeValidator(_api_key)] = Field(default=None, repr=False)
    # Bodies larger than this are refused (413) before they are parsed.
    max_request_body: Annotated[int, BeforeValidator(_request_body_limit),
                                PlainSerializer(format_size)] = DEFAULT_MAX_REQUEST_BODY

    @field_validator("host")
    @classmethod
    def _listenable_host(cls, host: str) -> str:
        return _check_host(host)


_ENDPOINT_RE = re.compile(r"^tcp://(\*|\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d{1,5})$")


def _zmq_endpoint(value: Any) -> str:
    """`tcp://HOST:PORT` (HOST an address of this machine, a host name that resolves, or `*` for
    every interface) or `ipc://PATH`: what a ZMQ socket can bind."""
    if not isinstance(value, str):
        raise ValueError(f"expected tcp://host:port or ipc://path, got {_short_repr(value)}")
    value = value.strip()
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    match = _ENDPOINT_RE.match(value)
    if match is None:
        raise ValueError(f"expected tcp://host:port or ipc://path, got {_short_repr(value)}")
    host, port = match.group(1), int(match.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if host != "*":
        _check_host(host.strip("[]"))
    return value


ZmqEndpoint = Annotated[str, PlainValidator(_zmq_endpoint)]


def next_endpoint(endpoint: str) -> str:
    """The replay endpoint that goes with `endpoint` by default: the next port, or `PATH.replay`."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    base, _, port = endpoint.rpartition(":")
    if int(port) >= 65535:
        raise ValueError(f"{endpoint} leaves no next port for replay: set events.replay_endpoint")
    return f"{base}:{int(port) + 1}"


class EventsConfig(_Section):
    """KV events (README, "KV events"): the tiers' BlockStored / BlockRemoved / AllBlocksCleared,
    published as vLLM does, msgpack over a ZMQ PUB socket bound at `endpoint`, with a ROUTER socket
    at `replay_endpoint` (default: the next port) that resends the last `replay_buffer` batches.
    At most `queue_size` events wait for the publisher thread; more are dropped and counted."""

    endpoint: ZmqEndpoint
    replay_endpoint: ZmqEndpoint | None = None  # None: `next_endpoint(endpoint)`, filled in at load
    replay_buffer: PositiveInt = 10_000
    queue_size: PositiveInt = 100_000
    topic: str = ""

    @model_validator(mode="after")
    def _replay_beside(self) -> EventsConfig:
        if self.replay_endpoint is None:
            try:  # frozen: the default is filled in once, here, so the resolved config shows it
                object.__setattr__(self, "replay_endpoint", next_endpoint(self.endpoint))
            except ValueError as exc:
                raise _FieldError("replay_endpoint", str(exc)) from None
        if self.replay_endpoint == self.endpoint:
            raise _FieldError("replay_endpoint", "must differ from events.endpoint")
        return self


def _http_url(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", value.strip()):
        raise ValueError(f"expected http://host:port, got {_short_repr(value)}")
    return value.strip().rstrip("/")


class ReplicaConfig(_Section):
    """One `kvstrata serve` behind the router: its HTTP base URL and, to be routed to by what it
    caches, its KV events endpoint (its `events.endpoint`; replay: its `events.replay_endpoint`)."""

    url: Annotated[str, PlainValidator(_http_url)]
    events: ZmqEndpoint | None = None  # None: routed by load alone
    replay: ZmqEndpoint | None = None  # None: `next_endpoint(events)`, filled in at load

    @model_validator(mode="after")
    def _replay_beside(self) -> ReplicaConfig:
        if self.events is not None and self.replay is None:
            try:
                object.__setattr__(self, "replay", next_endpoint(self.events))
            except ValueError as exc:
                raise _FieldError("replay", str(exc)) from None
        return self


class RouterConfig(_Section):
    """`kvstrata route` (README, "Cache-aware routing"): where it listens and the replicas it sends to.
    The config's `model` and `cache` sections must be the replicas' (same model, dtype, block size
    and hash), so that the router names blocks as they do."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    replicas: Annotated[list[ReplicaConfig], Field(min_length=1)]
    health_interval: Duration = 1.0   # seconds between health checks of each replica
    request_timeout: Duration = 600.0  # the longest a replica may take to answer (a long prefill on a CPU)
    # a replica holding the prompt's prefix with this many more requests in flight than the least loaded
    # one gives the request up to it: a hot document does not pile every request onto one replica
    max_load_gap: Annotated[int, Field(ge=1)] = 16

    @field_validator("host")
    @classmethod
    def _listenable_host(cls, host: str) -> str:
        return _check_host(host)


class Config(_Section):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    events: EventsConfig | None = None  # off when left out
    router: RouterConfig | None = None  # only `kvstrata route` reads it

    @field_validator("model", "cache", "scheduler", "server", mode="before")
    @classmethod
    def _empty_is_default(cls, section: Any) -> Any:
        # `server:` with every key commented out is YAML null: it means "the defaults", not "off".
        return {} if section is None else section

    @model_validator(mode="after")
    def _tiers_fit_the_machine(self, info: ValidationInfo) -> Config:
        """Every tier's bytes, whether its size was given in bytes or in blocks, against the memory or
        disk that would hold it: the device's memory; the RAM available now for the CPU tier plus a
        device tier on the CPU (pinned memory counted as the allocator rounds it); the disk's room."""
        tiers = self.cache.tiers
        tier_bytes = _TierBytes(self)
        where, capacity = _device_capacity(self.model.device)
        device_bytes = tier_bytes(tiers.device.size)
        if capacity is not None and device_bytes > capacity:
            raise _FieldError("cache.tiers.device.size", f"{tier_bytes.describe(tiers.device.size)} is more than "
                                                         f"{where} ({format_bytes(capacity)})")
        if tiers.cpu is not None:
            on_gpu = where != _RAM
            ram = _available_ram_bytes() - (0 if on_gpu else device_bytes)
            needed = tier_bytes(tiers.cpu.size)
            if tiers.cpu.pinned and on_gpu:
                needed = pinned_allocation_bytes(needed)
            if needed > ram:
                rounded = f" (pinned: {format_bytes(needed)} once rounded up)" if tiers.cpu.pinned and on_gpu else ""
                beside = "" if on_gpu else " beside the device tier"
                raise _FieldError("cache.tiers.cpu.size", f"{tier_bytes.describe(tiers.cpu.size)}{rounded} is more than "
                                                          f"the RAM available{beside} ({format_bytes(ram)})")
        if tiers.disk is not None and not _disk_read_only(info):
            try:
                check_room(tiers.disk.path, tier_bytes(tiers.disk.size), spelled=tier_bytes.describe(tiers.disk.size))
            except ValueError as exc:
                raise _FieldError("cache.tiers.disk.size", str(exc)) from None
        return self

    def resolved_device(self) -> str:
        """`model.device` with `auto` resolved: "cuda" when torch sees a CUDA device, else "cpu"."""
        if self.model.device != "auto":
            return self.model.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        """`model.dtype` with `auto` resolved for the resolved device (see `auto_dtype`)."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return auto_dtype(self.resolved_device())

    def resolved_kv_cache_dtype(self) -> str:
        """`cache.kv_cache_dtype` as a torch dtype name, `auto` being the resolved model dtype."""
        if self.cache.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        return KV_CACHE_DTYPES[self.cache.kv_cache_dtype]

    def resolved_threads(self) -> int:
        """`model.threads` with `auto` resolved (see `default_threads`)."""
        return default_threads() if self.model.threads == "auto" else self.model.threads

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able data; `load_config(config.to_dict())` gives an equal Config."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The config as YAML for people to read: secrets (the API key, the remote tier's password) are masked."""
        data = self.to_dict()
        if data["server"]["api_key"] is not None:
            data["server"]["api_key"] = SECRET_MASK
        if data["cache"]["tiers"]["remote"] is not None:
            data["cache"]["tiers"]["remote"]["url"] = masked_url(self.cache.tiers.remote.url)
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(source: str | os.PathLike | Mapping | Config | None = None,
                overrides: Mapping[str, Any] | list[str] | str | None = None, *,
                disk_read_only: bool = False) -> Config:
    """Load and validate a config.

    `source`: a YAML file path, a dict shaped like the YAML, an existing Config, or None (the
    built-in defaults: the embedded model and a 1GiB device tier, no lower tiers).
    `overrides`: `{"dotted.key": value}` or `["dotted.key=value", ...]` (values parsed as YAML
    scalars; `key=null` removes a lower tier). Precedence: source < environment (see
    `ENV_OVERRIDES`; not re-applied to an existing Config) < overrides.
    `disk_read_only`: for a command that only reads the disk store (`kvstrata cache stats`): its
    path is then neither created nor required to be writable or roomy.
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
    return _validate(raw, env_sources, {"disk_read_only": disk_read_only})


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
    if data is None:  # an empty file, or comments only: most likely the wrong file, so not "the defaults"
        raise ConfigError(None, f"{path}: the file is empty; give at least one section (model, cache, scheduler, "
                                "server), or leave --config out for the built-in defaults")
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


def _disk_read_only(info: ValidationInfo) -> bool:
    """Validating for a command that only reads the disk store (`load_config(disk_read_only=True)`)."""
    return bool((info.context or {}).get("disk_read_only"))


def _validate(raw: dict[str, Any], env_sources: Mapping[str, str], context: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw, context=context)
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


_RAM = "the RAM available"


def _available_ram_bytes() -> int:
    """RAM that a new allocation can have now (what other processes use is not ours to take)."""
    return psutil.virtual_memory().available


def pinned_allocation_bytes(nbytes: int) -> int:
    """What a pinned host allocation of `nbytes` really takes: torch's caching host allocator rounds
    every request up to a power of two (a 33 GiB slab pins 64 GiB)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


class _TierBytes:
    """A tier size in bytes, a block count converted with the model's block size (read once, lazily:
    it needs the model's shape and the resolved dtype)."""

    def __init__(self, config: Config):
        self.config = config
        self._block_nbytes: int | None = None

    @property
    def block_nbytes(self) -> int:
        if self._block_nbytes is None:
            self._block_nbytes = self.config.model.shape().kv_block_nbytes(self.config.cache.block_size,
                                                                           _dtype_for_sizing(self.config))
        return self._block_nbytes

    def __call__(self, size: Size) -> int:
        return size.nbytes if size.is_bytes else size.to_bytes(self.block_nbytes)

    def describe(self, size: Size) -> str:
        if size.is_bytes:
            return format_size(size.nbytes)
        return f"{size.num_blocks} blocks ({format_bytes(self(size))} at {self.block_nbytes} bytes a block)"


def _dtype_for_sizing(config: Config) -> str:
    """The dtype a block will have, without importing torch where the answer does not need it:
    `auto` is 2 bytes on any GPU (bfloat16 or float16) and needs torch's CPU check only on a CPU."""
    if config.cache.kv_cache_dtype != "auto":
        return KV_CACHE_DTYPES[config.cache.kv_cache_dtype]
    if config.model.dtype != "auto":
        return config.model.dtype
    where, _ = _device_capacity(config.model.device)
    return "bfloat16" if where != _RAM else auto_dtype("cpu")


def auto_dtype(device: str) -> str:
    """What `model.dtype: auto` means on `device` (a resolved device: "cpu", "cuda", "cuda:N").

    On a GPU, bfloat16 where the GPU computes it natively (compute capability 8.0 and later), else
    float16. On a CPU, float32: without bfloat16 matrix units a CPU computes bfloat16 more slowly
    than float32 (measured 1.5x on a 2k-token prompt on one CPU; 60x per matrix product on one
    without AVX-512, where the engine warns at start), and float32 cache hits give exactly the
    uncached outputs. CPUs with AMX tiles multiply bfloat16 in hardware, so they get bfloat16.
    """
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return "bfloat16" if _cuda_capability(index) >= (8, 0) else "float16"
    return "bfloat16" if _cpu_has_amx() else "float32"


def _cuda_capability(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


def _cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (and the OS lets torch use them), as torch's CPU check says.

    Where /proc/cpuinfo lists no `amx_tile` flag the answer is no without importing torch, so that
    checking a config with tiers sized in blocks stays cheap on the CPUs most machines have."""
    flags = _cpuinfo_flags()
    if flags is not None and "amx_tile" not in flags:
        return False
    import torch
    is_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_supported and is_supported())


def _cpuinfo_flags() -> set[str] | None:
    """The first CPU's feature flags from /proc/cpuinfo; None where it does not say (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return None


def default_threads() -> int:
    """The torch thread count `model.threads: auto` picks: one per physical core this process may
    run on, at most `MAX_AUTO_THREADS`, and one on a machine with two cores or fewer.

    Why one there: intra-op threads meet at a barrier after every operator, so a request runs at the
    pace of its slowest thread, and on two cores any other busy process deschedules one of the two.
    Measured on a 2-core machine shared with other work (benchmarks/results/threads.md): with two
    threads a 58-token prompt took 15x longer at the median than with one (13 s against 0.9 s) and
    a 500-token prefill 4x longer. Where the machine is otherwise idle, `model.threads: 2` may be faster.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or usable
    cores = min(usable, physical)
    return 1 if cores <= 2 else min(cores, MAX_AUTO_THREADS)


def _device_capacity(device: str) -> tuple[str, int | None]:
    """Where the device tier would live and how many bytes that memory holds (None: unknown)."""
    if device == "cpu":
        return _RAM, _available_ram_bytes()
    index = int(device.partition(":")[2] or 0)
    gpu_bytes = _gpu_memory_bytes(index, explicit=device != "auto")
    if device == "auto" and gpu_bytes is None:
        return _RAM, _available_ram_bytes()
    return f"the memory of cuda:{index}", gpu_bytes


def _gpu_memory_bytes(index: int, explicit: bool = False) -> int | None:
    """Total memory of CUDA device `index`, or None when there is no such device.

    Asks torch when it is already imported (the engine); otherwise nvidia-smi, so that validating
    a config stays cheap. Where nvidia-smi cannot answer and the config names a CUDA device
    (`explicit`), torch is asked after all: a missing device must be refused here, not at serve time.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        found = _nvidia_smi_memory_bytes(index)
        if found is not None or not explicit or shutil.which("nvidia-smi") is not None:
            return found
        import torch
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_properties(index).total_memory


def _describe_cuda_devices() -> str:
    count = 0
    while _gpu_memory_bytes(count) is not None:
        count += 1
    return "no CUDA device is visible" if count == 0 else f"visible: cuda:0 to cuda:{count - 1}"


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


def _check_host(host: str) -> str:
    """`server.host` must be an address this machine could listen on: an IP address, or a host
    name that resolves. Checked here so that `config check` refuses what `serve` could not bind."""
    host = host.strip()
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL_RE.match(label) for label in labels) \
            or labels[-1].isdigit():
        raise ValueError(f"{host!r} is neither an IP address nor a host name")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}") from None
    return host
