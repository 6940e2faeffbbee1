"""The schema: every key a user writes in YAML, its type and default, and the checks that tie keys
together. Value types live in fields.py, the machine checks in machine.py."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, PlainValidator,
                      ValidationInfo, field_validator, model_validator)

from kvstrata.engine.config.fields import (DEVICE_RE, AutoBool, FieldError, KV_CACHE_DTYPES, Dtype, Duration,
                                           DurationOrZero, Fraction, KVCacheDtype, PositiveInt, ReadProcesses,
                                           SizeField, Threads, ZmqEndpoint, check_api_key, check_host, http_url,
                                           next_endpoint, remote_url, request_body_limit, short_repr, some_size)
from kvstrata.engine.config import machine
from kvstrata.engine.config.probes import auto_dtype, default_threads
from kvstrata.engine.model_spec import (EMBEDDED_MODEL, LENGTH_DEPENDENT_ROPE, PRESETS, ModelShape, is_gguf_file,
                                      model_shape)
from kvstrata.engine.sizes import Size, format_size
from kvstrata.tiers.remote_url import DEFAULT_QUEUE_BYTES, SECRET_MASK, check_url, masked_url
from kvstrata.tiers.storage import check_no_file_at, prepare_private_dir

DEFAULT_DEVICE_TIER_SIZE = Size(nbytes=1024**3)
DEFAULT_MAX_REQUEST_BODY = 32 * 1024**2  # a 2k-token document is ~10 KB of JSON; a 128k-token one ~0.6 MB


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
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    max_model_len: PositiveInt | None = None  # None: the model's own limit
    threads: Threads = "auto"  # torch's CPU threads; auto: see `default_threads`
    # Reductions in an order no batch or chunking changes: cached and uncached outputs then agree bit for bit in
    # every dtype. Its K/V get their own hash namespace. auto: on where it was measured to cost next to nothing
    # (the compiled CPU kernels on AVX2; `kernels.INVARIANT_BY_DEFAULT`; the figures are in docs/configuration.md).
    batch_invariant: AutoBool = "auto"
    # Steps of few tokens (decodes, questions) replayed as CUDA graphs (engine/cuda_graphs.py) on a CUDA device;
    # ignored on a CPU with device auto. On in configs/gpu.yaml; off by default here, where the CPU is the default.
    cuda_graphs: bool = False

    @field_validator("name")
    @classmethod
    def _canonical_name(cls, name: str) -> str:
        if name.strip().lower() == EMBEDDED_MODEL:
            return EMBEDDED_MODEL
        path = Path(name).expanduser()
        return os.path.abspath(path) if path.is_dir() or is_gguf_file(name) else name.strip()

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str, info: ValidationInfo) -> str:
        canonical = device.strip().lower()
        if not DEVICE_RE.match(canonical):
            raise ValueError(f"unknown device {device!r} (expected auto, cpu, cuda or cuda:N)")
        if canonical.startswith("cuda") and _for_machine(info):
            index = int(canonical.partition(":")[2] or 0)
            if machine.gpu_memory_bytes(index, explicit=True) is None:
                raise ValueError(f"{canonical}: no such CUDA device on this machine "
                                 f"({machine.describe_cuda_devices()}; use cpu or auto)")
        return canonical

    @model_validator(mode="after")
    def _runnable_model(self) -> ModelConfig:
        if self.cuda_graphs and self.device == "cpu":
            raise FieldError("cuda_graphs", "CUDA graphs need a CUDA device, and model.device is cpu "
                                             "(use device auto or cuda, or turn cuda_graphs off)")
        shape = self.shape()
        if self.cuda_graphs and shape.rope_type in LENGTH_DEPENDENT_ROPE:
            raise FieldError("cuda_graphs", f"the model's RoPE ({shape.rope_type!r}) changes its frequencies with "
                                             "the sequence's length, which a recorded graph cannot follow "
                                             "(turn cuda_graphs off)")
        if self.max_model_len is not None and self.max_model_len > shape.max_model_len:
            raise FieldError("max_model_len", f"{self.max_model_len} is more than the model's limit of "
                                               f"{shape.max_model_len} tokens")
        return self

    def shape(self) -> ModelShape:
        """The model's architecture and KV shape, read from its config (no weights are loaded)."""
        if self.load_format == "dummy" and self.name in PRESETS:
            return model_shape(self.name, self.load_format)
        gguf = is_gguf_file(self.name)
        if self.name != EMBEDDED_MODEL and not gguf and not (Path(self.name) / "config.json").is_file():
            presets = f", or with load_format: dummy a preset ({', '.join(PRESETS)})"
            raise FieldError("name", f"{self.name!r} is neither the embedded model {EMBEDDED_MODEL!r}, a local "
                                      f"model directory with a config.json nor a GGUF file{presets}")
        if (self.name == EMBEDDED_MODEL or gguf) and self.load_format == "dummy":
            raise FieldError("load_format", f"dummy needs a model config: a preset ({', '.join(PRESETS)}) "
                                             "or a model directory")
        try:
            return model_shape(self.name, self.load_format)
        except ValueError as exc:
            raise FieldError("name", f"{self.name}: {exc}") from None

    @property
    def is_embedded(self) -> bool:
        return self.name == EMBEDDED_MODEL

class DeviceTierConfig(_Section):
    size: SizeField = DEFAULT_DEVICE_TIER_SIZE

    @field_validator("size")
    @classmethod
    def _on(cls, size: Size) -> Size:
        return some_size(size, "the device tier cannot be off")


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
            raise ValueError(f"expected a directory path, got {short_repr(path)}")
        return Path(os.path.abspath(Path(path).expanduser()))

    @model_validator(mode="after")
    def _writable(self, info: ValidationInfo) -> DiskTierConfig:
        # An off tier touches nothing; a command that only reads the store neither creates nor writes it, but a
        # file where the store should be is refused all the same.
        if self.size.is_off:
            return self
        try:
            if _disk_read_only(info):
                check_no_file_at(self.path)
            else:
                prepare_private_dir(self.path)  # created 0700: stored token ids decode back to prompts
        except ValueError as exc:
            raise FieldError("path", str(exc)) from None
        return self

class RemoteTierConfig(_Section):
    """A Valkey or Redis server (or cluster) shared by replicas; its own eviction (`maxmemory`,
    `allkeys-lru`) bounds it, so it has no size here. `ttl` 0: blocks never expire."""

    url: Annotated[str, BeforeValidator(remote_url)] = Field(repr=False)  # may carry a password: masked when shown
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
        return some_size(size, "the write queue cannot be empty")

    @field_validator("key_prefix")
    @classmethod
    def _plain_prefix(cls, prefix: str) -> str:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"expected a non-empty prefix without spaces, got {short_repr(prefix)}")
        return prefix

    @model_validator(mode="after")
    def _usable_url(self) -> RemoteTierConfig:
        try:
            check_url(self.url, self.cluster)
        except ValueError as exc:
            raise FieldError("url", str(exc)) from None
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
            raise ValueError(f"expected a file path, got {short_repr(path)}")
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
    # write_back: LMCache's and SGLang's name for on_evict (a block goes down when it leaves the device)
    offload: Annotated[Literal["write_through", "on_evict"],
                       BeforeValidator(lambda v: "on_evict" if v == "write_back" else v)] = "write_through"
    # whether blocks holding generated tokens go down too (LMCache's save_decode_cache): off, an answer stays on
    # the device until a later prompt reuses it (a chat's next turn), leaving the lower tiers to the prompts
    offload_answers: bool = False
    pin_share: Fraction = 0.5
    preload: tuple[PreloadConfig, ...] = ()
    # whether a prefix found below the device is loaded or recomputed (engine/load_policy.py)
    load_policy: Literal["auto", "always_load", "always_recompute"] = "auto"
    # what the K/V are kept in, on the device and in every tier: auto is the model's dtype; fp8 (e4m3)
    # halves a bf16 block and quarters a float32 one; int8 (scaled rows) nearly so, losing less
    # (docs/dtype.md, "KV cache dtype")
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
            raise ValueError(f"expected a list of {{file, cache_salt, pin}}, got {short_repr(entries)}")
        return tuple(entries)

    @model_validator(mode="after")
    def _preload_needs_caching(self) -> CacheConfig:
        if self.preload and not self.enable_prefix_caching:
            raise FieldError("preload", "needs cache.enable_prefix_caching: true")
        return self


class SchedulerConfig(_Section):
    """How requests share the engine's steps (docs/scheduling.md, "Scheduling under concurrency").

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
    # A step or a prefix load with no progress for this long is named in the log, once (engine/watchdog.py); 0: off.
    watchdog_timeout: DurationOrZero = 60.0

class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port
    model_alias: str | None = None  # the model id served by /v1/models; None: model.name
    # Clients must send `Authorization: Bearer <api_key>` to /v1/*; None: no key. Masked when printed.
    api_key: Annotated[str | None, BeforeValidator(check_api_key)] = Field(default=None, repr=False)
    # Bodies larger than this are refused (413) before they are parsed.
    max_request_body: Annotated[int, BeforeValidator(request_body_limit),
                                PlainSerializer(format_size)] = DEFAULT_MAX_REQUEST_BODY
    # On SIGTERM, how long requests in flight may finish before they are aborted and the cache is
    # written down: below Kubernetes' default grace period (`terminationGracePeriodSeconds: 30`), so the
    # write-down has time too.
    drain_timeout: DurationOrZero = 25.0
    vllm_metrics: bool = True  # also export the vllm:* series vLLM's dashboards and autoscalers read
    # A line per HTTP request on the `kvstrata.access` logger: method, path, status, time, request id (never a body).
    access_log: bool = False
    # Seconds between the stats lines logged while the server is busy (requests, tokens/s, hits and promotions
    # per tier); 0: none.
    stats_interval: DurationOrZero = 10.0
    # Each request appended to this Mooncake-format trace (kvstrata/trace.py: lengths and ids derived from
    # chain hashes, never token ids or text), for `kvstrata plan`; None: no trace is written.
    trace_log: Path | None = None

    @field_validator("trace_log", mode="before")
    @classmethod
    def _absolute_trace_log(cls, path: Any) -> Path | None:
        if path is None:
            return None
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise ValueError(f"expected a file path, got {short_repr(path)}")
        return Path(os.path.abspath(Path(path).expanduser()))

    @field_validator("host")
    @classmethod
    def _listenable_host(cls, host: str) -> str:
        return check_host(host)

class EventsConfig(_Section):
    """KV events (docs/events.md, "KV events"): the tiers' BlockStored / BlockRemoved / AllBlocksCleared,
    published as vLLM does, msgpack over a ZMQ PUB socket bound at `endpoint`, with a ROUTER socket
    at `replay_endpoint` (default: the next port) that resends the last `replay_buffer` batches.
    At most `queue_size` events wait for the publisher thread; more are dropped and counted."""

    endpoint: ZmqEndpoint
    replay_endpoint: ZmqEndpoint | None = None  # None: `next_endpoint(endpoint)`, filled in at load
    # vLLM's KVEventsConfig names are accepted too (buffer_steps, max_queue_size, publisher).
    replay_buffer: PositiveInt = Field(10_000, validation_alias=AliasChoices("replay_buffer", "buffer_steps"))
    queue_size: PositiveInt = Field(100_000, validation_alias=AliasChoices("queue_size", "max_queue_size"))
    topic: str = ""
    publisher: Literal["zmq"] = "zmq"
    # vllm: vLLM 0.26+'s events, tagged maps; vllm_legacy: the positional arrays of vLLM before it, for
    # routers that decode only those (docs/events.md, "Formats")
    format: Literal["vllm", "vllm_legacy"] = "vllm"
    # vllm: media GPU, CPU and STORAGE (disk and remote told apart by `locality`), the names routers built
    # for vLLM score; kvstrata: DISK and REMOTE as media of their own
    medium_names: Literal["vllm", "kvstrata"] = "vllm"
    int_hashes: bool = False  # block hashes as vLLM's 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    @model_validator(mode="after")
    def _replay_beside(self) -> EventsConfig:
        if self.replay_endpoint is None:
            try:  # frozen: the default is filled in once, here, so the resolved config shows it
                object.__setattr__(self, "replay_endpoint", next_endpoint(self.endpoint))
            except ValueError as exc:
                raise FieldError("replay_endpoint", str(exc)) from None
        if self.replay_endpoint == self.endpoint:
            raise FieldError("replay_endpoint", "must differ from events.endpoint")
        return self

class ReplicaConfig(_Section):
    """One `kvstrata serve` behind the router: its HTTP base URL and, to be routed to by what it
    caches, its KV events endpoint (its `events.endpoint`; replay: its `events.replay_endpoint`)."""

    url: Annotated[str, PlainValidator(http_url)]
    events: ZmqEndpoint | None = None  # None: routed by load alone
    replay: ZmqEndpoint | None = None  # None: `next_endpoint(events)`, filled in at load

    @model_validator(mode="after")
    def _replay_beside(self) -> ReplicaConfig:
        if self.events is not None and self.replay is None:
            try:
                object.__setattr__(self, "replay", next_endpoint(self.events))
            except ValueError as exc:
                raise FieldError("replay", str(exc)) from None
        return self


class RouterConfig(_Section):
    """`kvstrata route` (docs/routing.md, "Cache-aware routing"): where it listens and the replicas it sends to.
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
    # `prefix` places a request where its prompt's prefix is cached; `round_robin` and `random` ignore the
    # caches (the baselines that placement by prefix is measured against, and a plain load balancer)
    policy: Literal["prefix", "round_robin", "random"] = "prefix"

    @field_validator("host")
    @classmethod
    def _listenable_host(cls, host: str) -> str:
        return check_host(host)

    @field_validator("replicas")
    @classmethod
    def _each_replica_once(cls, replicas: list[ReplicaConfig]) -> list[ReplicaConfig]:
        """A URL listed twice would double one replica's share of requests; an events endpoint listed twice would
        feed one replica's events into another's index."""
        first: dict[tuple[str, str], int] = {}
        for i, replica in enumerate(replicas):
            for key, value in (("url", replica.url), ("events", replica.events)):
                if value is not None and first.setdefault((key, value), i) != i:
                    shown = masked_url(value) if key == "url" else value
                    raise FieldError(f"{i}.{key}", f"{shown!r} is listed twice (replicas {first[key, value]} and {i})")
        return replicas


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
        if _for_machine(info):
            machine.check_attention_backend(self)
            machine.check_tiers_fit(self, disk=not _disk_read_only(info))
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


def _disk_read_only(info: ValidationInfo) -> bool:
    """Validating for a command that only reads the disk store (`load_config(disk_read_only=True)`)."""
    return bool((info.context or {}).get("disk_read_only"))


def _for_machine(info: ValidationInfo) -> bool:
    """Validating a config to run here, not one describing another machine (`load_config(for_machine=False)`:
    `kvstrata plan` sizes the tiers of a machine not yet bought, which may have GPUs this one lacks)."""
    return bool((info.context or {}).get("for_machine", True))
