"""vLLM's engine arguments, spelled as vLLM users type them, mapped onto our config keys.

One table serves both faces: `kvstrata serve MODEL --max-model-len 4096 ...` (each name as a
`--dashed-flag`) and `LLM(model=..., max_model_len=4096, ...)` (each name as a keyword). Both
give their values as overrides on top of the config file, so an argument beats the file, as in vLLM.
A value the config refuses is one line naming the argument as the user spelled it, then the key.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.config.fields import ConfigError


@dataclass(frozen=True)
class EngineArg:
    name: str  # vLLM's keyword; the flag is `--name-with-dashes`
    key: str   # the dotted config key it sets
    kind: type  # what a command-line string is parsed as: str, int or bool
    help: str
    server_only: bool = False  # meaningless to the offline `LLM` (where it listens, who may call it)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_ARGS = (
    EngineArg("model", "model.name", str,
              "the embedded model's name, a local Hugging Face model directory or a GGUF file"),
    EngineArg("dtype", "model.dtype", str, "auto, float32, bfloat16 or float16 (bf16, fp16, half, float)"),
    EngineArg("max_model_len", "model.max_model_len", int, "the longest prompt plus output, in tokens"),
    EngineArg("device", "model.device", str, "auto, cpu, cuda or cuda:N"),
    EngineArg("kv_cache_dtype", "cache.kv_cache_dtype", str, "auto, fp8, fp8_e5m2, int8, bfloat16, float16, float32"),
    EngineArg("block_size", "cache.block_size", int, "tokens a KV block holds: 8, 16, 32 or 64"),
    EngineArg("enable_prefix_caching", "cache.enable_prefix_caching", bool, "cache prompt prefixes (default on)"),
    EngineArg("max_num_seqs", "scheduler.max_num_seqs", int, "the most requests a step runs"),
    EngineArg("max_num_batched_tokens", "scheduler.max_num_batched_tokens", int, "the most tokens a step computes"),
    EngineArg("served_model_name", "server.model_alias", str, "the model id /v1/models serves", server_only=True),
    EngineArg("host", "server.host", str, "address to listen on", server_only=True),
    EngineArg("port", "server.port", int, "port to listen on", server_only=True),
    EngineArg("api_key", "server.api_key", str, "require 'Authorization: Bearer KEY' on /v1 "
                                                "($KVSTRATA_API_KEY keeps it out of the process list)",
              server_only=True),
)
BY_NAME = {arg.name: arg for arg in ENGINE_ARGS}
OFFLINE_ARGS = tuple(arg for arg in ENGINE_ARGS if not arg.server_only)


def engine_arg_overrides(values: Mapping[str, Any], spell: Callable[[EngineArg], str],
                         allowed: tuple[EngineArg, ...] = ENGINE_ARGS) -> dict[str, Any]:
    """`{"max_model_len": 4096}` -> `{"model.max_model_len": 4096}`; None values are left out (not given).
    A name not in `allowed` is a ConfigError naming the ones that are."""
    known = {arg.name: arg for arg in allowed}
    overrides = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(None, f"{name}: unknown argument (expected one of "
                                    f"{', '.join(spell(arg) for arg in allowed)})")
        if value is not None:
            overrides[known[name].key] = value
    return overrides


def parse_arg_text(arg: EngineArg, text: str) -> Any:
    """A command-line string as the argument's kind; a bad one is a ConfigError naming the flag."""
    if arg.kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(None, f"{arg.flag}: expected an integer, got {text!r}") from None
    return text


def blame_engine_arg(error: ConfigError, given: Mapping[str, Any], spell: Callable[[EngineArg], str]) -> ConfigError:
    """A config error about a key an argument set, said with the argument's spelling first
    (`--max-model-len (model.max_model_len): ...`); any other error as it was."""
    for name, value in given.items():
        arg = BY_NAME.get(name)
        if value is not None and arg is not None and error.key == arg.key:
            return ConfigError(f"{spell(arg)} ({arg.key})", error.message)
    return error
