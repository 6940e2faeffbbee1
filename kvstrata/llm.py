"""`kvstrata.LLM`: the engine's offline API, taking vLLM's keywords as well as a config, and publishing KV events
when its config has an `events` section (as `kvstrata serve` does with the same config); the engine itself knows
nothing of ZMQ."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from kvstrata.engine.config import Config, ConfigError, EventsConfig, load_config
from kvstrata.engine.config.engine_args import OFFLINE_ARGS, blame_engine_arg, engine_arg_overrides
from kvstrata.engine.llm import LLM as EngineLLM
from kvstrata.serving.events import KVEventPublisher

_YAML_SUFFIXES = (".yaml", ".yml")


class LLM(EngineLLM):
    """kvstrata's offline entry point, as vLLM's:

        llm = LLM(model="smollm2-135m-instruct", max_model_len=4096, dtype="float32")
        llm = LLM("configs/default.yaml")                       # a config: a YAML path, a dict or a Config
        llm = LLM("configs/gpu.yaml", max_model_len=4096)      # a config and keywords on top of it
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))

    The keywords (engine/config/engine_args.py, shared with `kvstrata serve`'s flags) beat the config.
    """

    def __init__(self, model: str | os.PathLike | Mapping | Config | None = None, *,
                 config: str | os.PathLike | Mapping | Config | None = None,
                 loaded_model: Any = None, events: Any = None, **engine_args: Any):
        super().__init__(llm_config(model, config, engine_args), loaded_model=loaded_model, events=events)

    def _own_event_publisher(self, events_config: EventsConfig) -> KVEventPublisher:
        return KVEventPublisher(events_config)


def llm_config(model: Any, config: Any, engine_args: Mapping[str, Any]) -> Config:
    """The Config `LLM(model, config=..., **engine_args)` runs. `model` is a config when it is a YAML path, a
    dict or a Config (kvstrata's own way, kept); otherwise it is the model, as vLLM's first argument is."""
    if _is_config(model):
        if config is not None:
            raise ConfigError(None, "LLM: give the config once, as the first argument or as config=")
        model, config = None, model
    if model is None:
        model = engine_args.get("model")
    # a path becomes its string; anything else goes as it is, for the config to refuse by name
    given = {**engine_args, "model": os.fspath(model) if isinstance(model, os.PathLike) else model}
    try:
        overrides = engine_arg_overrides(given, lambda arg: arg.name, allowed=OFFLINE_ARGS)
        return load_config(config, overrides or None) if overrides or not isinstance(config, Config) else config
    except ConfigError as exc:
        raise blame_engine_arg(exc, given, lambda arg: arg.name) from None


def _is_config(value: Any) -> bool:
    if isinstance(value, (Mapping, Config)):
        return True
    return isinstance(value, (str, os.PathLike)) and Path(value).suffix.lower() in _YAML_SUFFIXES
