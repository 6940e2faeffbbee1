"""Loading a config: YAML (duplicate keys refused), environment overrides, `--set` overrides,
then validation into a `Config`, every pydantic error translated into one `ConfigError` line."""
from __future__ import annotations

import copy
import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvstrata.engine.config.fields import ConfigError, FieldError, one_line, short_repr
from kvstrata.engine.config.schema import Config

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


def load_config(source: str | os.PathLike | Mapping | Config | None = None,
                overrides: Mapping[str, Any] | list[str] | str | None = None, *,
                disk_read_only: bool = False, for_machine: bool = True) -> Config:
    """Load and validate a config.

    `source`: a YAML file path, a dict shaped like the YAML, an existing Config, or None (the
    built-in defaults: the embedded model and a 1GiB device tier, no lower tiers).
    `overrides`: `{"dotted.key": value}` or `["dotted.key=value", ...]` (values parsed as YAML
    scalars; `key=null` removes a lower tier). Precedence: source < environment (see
    `ENV_OVERRIDES`; not re-applied to an existing Config) < overrides.
    `disk_read_only`: for a command that only reads the disk store (`kvstrata cache stats`): its
    path is then neither created nor required to be writable or roomy.
    `for_machine` False: the config describes another machine (`kvstrata plan` sizes tiers before they
    are bought): no tier is checked against the host's memory or disk, and no disk path is touched.
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
    return _validate(raw, env_sources, {"disk_read_only": disk_read_only or not for_machine,
                                        "for_machine": for_machine})


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
        raise ConfigError(None, f"{path}: malformed YAML: {one_line(str(exc))}") from None
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
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}` (values parsed as YAML scalars, but `LITERAL_OVERRIDES` taken
    as written); a dict passes through."""
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


# Secrets set with `--set` are taken as written: parsed as YAML, a key such as `&k3y` would be an anchor (null: no
# key at all, the server left open) and one YAML cannot parse would be echoed in the error.
LITERAL_OVERRIDES = ("server.api_key", "cache.tiers.remote.url")


def _parse_scalar(key: str, text: str) -> Any:
    if key in LITERAL_OVERRIDES:
        return text or None
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {text!r}: {one_line(str(exc))}") from None


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


def _validate(raw: dict[str, Any], env_sources: Mapping[str, str], context: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw, context=context)
    except ValidationError as exc:
        raise _translate(exc, env_sources) from None


# ---------------------------------------------------------------------------------------------
# One-line errors out of pydantic's


def _translate(exc: ValidationError, env_sources: Mapping[str, str]) -> ConfigError:
    errors = exc.errors(include_url=False)
    # an unknown key first: a misspelt one (`fil:`) also leaves the key it meant missing, which says less
    first = min(errors, key=lambda error: error["type"] != "extra_forbidden")
    loc = [str(part) for part in first["loc"]]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
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
    return ConfigError(key, one_line(message))


def _describe(error: dict[str, Any]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    got = short_repr(value)
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
