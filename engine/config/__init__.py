"""The engine's configuration: YAML in, typed frozen objects out (docs/design.md, "YAML").

    model:  {name: smollm2-135m-instruct, load_format: auto, dtype: auto, device: auto, attention_backend: auto,
             max_model_len: null, threads: auto, batch_invariant: auto, cuda_graphs: false}
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
      offload_answers: false    # true: generated tokens' blocks go down too, not only once a prompt reuses them
      pin_share: 0.5            # the most of the CPU and disk tiers that pinned documents may take
      preload: [{file: handbook.txt, cache_salt: null, pin: true}]   # documents cached at start-up
      load_policy: auto         # or always_load, always_recompute
    scheduler: {max_num_batched_tokens: 2048, max_num_seqs: 32}
    server: {host: 127.0.0.1, port: 8000, model_alias: null, api_key: null, max_request_body: 32MiB,
             trace_log: null}     # trace_log: a Mooncake-format trace of the traffic, for `kvstrata plan`
    events: {endpoint: "tcp://127.0.0.1:5557", replay_endpoint: null, replay_buffer: 10000,
             queue_size: 100000, topic: ""}     # KV events; off when left out
    router: {host: 127.0.0.1, port: 8080, health_interval: 1s, request_timeout: 600s,
             replicas: [{url: "http://127.0.0.1:8001", events: "tcp://127.0.0.1:5557", replay: null}]}

Where each part lives:

    schema.py   the keys a user writes: the sections, their types and defaults (`Config`)
    fields.py   the value types (sizes, durations, dtypes, endpoints) and `ConfigError`
    loading.py  `load_config`: YAML, environment and `--set` overrides, one-line errors
    machine.py  sizing (block counts to bytes) and whether each tier fits the host
    probes.py   what `auto` means here: the CPU's AMX, the GPU's capability, the thread count

The config is validated once, at the edge; inside the engine the types are trusted. Every problem
becomes one `ConfigError` whose message is a single line naming the dotted key
(`cache.tiers.dsk: unknown key`). Validation also checks the config against the model and the
machine, so that `kvstrata config check` refuses what `serve` would fail on: the model must be one
kvstrata runs (its shape is read from its config.json, not its weights), `max_model_len` within its
limit, a CUDA device must exist, the disk path must be writable (its directory is created, private
to its owner), and every tier size, in bytes or in blocks, must fit in the memory or disk that would hold it.

Invariants of a `Config`: the device tier is on; `cache.tiers.cpu` / `cache.tiers.disk` are None
exactly when that tier is off (left out, null, or sized 0), `cache.tiers.remote` when it is left out
or null; paths (the disk tier's, a model directory) are absolute, relative ones having been resolved
against the current directory at load time; dtype and device are spelled canonically (`bfloat16`,
`cuda:0`). `auto` values stay `auto` in the config (it describes what was asked); `resolved_device()`,
`resolved_dtype()` and `resolved_threads()` say what they mean on the machine that runs it.

This package must stay cheap to import: `kvstrata config check` uses it without torch.
"""
from kvstrata.engine.config.fields import KV_CACHE_DTYPES, ConfigError, next_endpoint
from kvstrata.engine.config.loading import ENV_OVERRIDES, load_config, parse_overrides
from kvstrata.engine.config.machine import pinned_allocation_bytes
from kvstrata.engine.config.probes import MAX_AUTO_THREADS, auto_dtype, cpu_has_amx, default_threads
from kvstrata.engine.config.schema import (DEFAULT_DEVICE_TIER_SIZE, DEFAULT_MAX_REQUEST_BODY, CacheConfig, Config,
                                           CpuTierConfig, DeviceTierConfig, DiskTierConfig, EventsConfig, ModelConfig,
                                           PreloadConfig, RemoteTierConfig, ReplicaConfig, RouterConfig,
                                           SchedulerConfig, ServerConfig, TiersConfig)

__all__ = ["ENV_OVERRIDES", "KV_CACHE_DTYPES", "MAX_AUTO_THREADS", "DEFAULT_DEVICE_TIER_SIZE",
           "DEFAULT_MAX_REQUEST_BODY", "CacheConfig", "Config", "ConfigError", "CpuTierConfig", "DeviceTierConfig",
           "DiskTierConfig", "EventsConfig", "ModelConfig", "PreloadConfig", "RemoteTierConfig", "ReplicaConfig",
           "RouterConfig", "SchedulerConfig", "ServerConfig", "TiersConfig", "auto_dtype", "cpu_has_amx",
           "default_threads", "load_config", "next_endpoint", "parse_overrides", "pinned_allocation_bytes"]
