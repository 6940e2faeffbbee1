"""The value types a config is written in, and the one-line error every problem becomes.

Sizes ("512MiB" or a block count), durations ("50ms"), dtypes and their aliases, fractions, ZMQ
endpoints, HTTP URLs, host names: each parsed and checked here, so that the schema (schema.py)
reads as the list of keys a user writes. Cheap to import: no torch.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, PlainValidator

from kvstrata.engine.sizes import Size
from kvstrata.tiers.remote_url import masked_url

# `cache.kv_cache_dtype` (vLLM's names) -> the torch dtype the K/V are kept in; auto: the model's dtype
# (int8: llama.cpp's q8_0 idea, rows scaled one by one, see kernels/kv_format.py)
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8",
                   "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class ConfigError(ValueError):
    """A problem with a config, as one line: `<dotted.key>: <what is wrong>`.

    `key` is the dotted key at fault, or None when the problem is the file itself (missing,
    malformed YAML), in which case the message names the file.
    """

    def __init__(self, key: str | None, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class FieldError(ValueError):
    """Raised inside validators to blame a key below the model being validated (e.g. `path`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(message)


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
        raise ValueError(f"expected a positive integer or auto, got {short_repr(value)}")
    if value <= 0:
        raise ValueError(f"must be positive (or auto), got {value}")
    return value


Threads = Annotated[int | str, PlainValidator(_threads)]


def _auto_or_bool(value: Any) -> bool | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not isinstance(value, bool):
        raise ValueError(f"expected true, false or auto, got {short_repr(value)}")
    return value


AutoBool = Annotated[bool | str, PlainValidator(_auto_or_bool)]

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: Any, allow_zero: bool) -> float:
    """A duration: "50ms", "0.2s", "10m", "1h", or a number of seconds."""
    text = str(value).strip().lower() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?", text)
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"] if match else -1.0
    if seconds < 0 or (seconds == 0 and not allow_zero):
        kind = "a duration" if allow_zero else "a positive duration"
        raise ValueError(f"expected {kind} such as 50ms or 0.2s, got {short_repr(value)}")
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
        raise ValueError(f"expected a fraction in (0, 1], got {short_repr(value)}")
    return float(value)


Fraction = Annotated[float, PlainValidator(_fraction)]


def some_size(size: Size, refusal: str) -> Size:
    """`size`, unless it is zero (which turns a tier off), where some size is needed."""
    if size.is_off:
        raise ValueError(f"{refusal}; give it a size such as 1GiB or a block count")
    return size


def remote_url(value: Any) -> Any:
    # Never echo a value here: a URL carries the password.
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a URL such as redis://127.0.0.1:6379/0")
    return value.strip()


def request_body_limit(value: Any) -> int:
    """A byte size: "32MiB", "1.5MB", or a plain number of bytes (not blocks: nothing here is a block)."""
    try:
        size = Size.parse(value)
    except ValueError:
        raise ValueError(f"expected a byte size such as '32MiB' or a number of bytes, got {short_repr(value)}") from None
    nbytes = size.nbytes if size.is_bytes else size.num_blocks
    if nbytes < 1:
        raise ValueError(f"must be at least one byte, got {value!r}")
    return nbytes


def check_api_key(value: Any) -> Any:
    # Never echo the value: a key mistyped as a number is still a secret.
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError("expected a non-empty string (leave it out, or null, for no key)")
    return value


_ENDPOINT_RE = re.compile(r"^tcp://(\*|\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d{1,5})$")


def _zmq_endpoint(value: Any) -> str:
    """`tcp://HOST:PORT` (HOST an address of the host, a host name that resolves, or `*` for
    every interface) or `ipc://PATH`: what a ZMQ socket can bind."""
    if not isinstance(value, str):
        raise ValueError(f"expected tcp://host:port or ipc://path, got {short_repr(value)}")
    value = value.strip()
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    match = _ENDPOINT_RE.match(value)
    if match is None:
        raise ValueError(f"expected tcp://host:port or ipc://path, got {short_repr(value)}")
    host, port = match.group(1), int(match.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if host != "*":
        check_host(host.strip("[]"))
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


def http_url(value: Any) -> str:
    """A server's base URL, `http(s)://host[:port]` (port 1 to 65535). A user or password is refused, and never
    echoed: the API key goes in a header, and clients would take `user:password@host` for a host name."""
    try:
        parts = urlsplit(value.strip()) if isinstance(value, str) else None
        valid = (parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
                 and parts.port != 0 and "@" not in parts.netloc and parts.path in ("", "/")
                 and not parts.query and not parts.fragment)
    except ValueError:  # a port out of range or not a number, a malformed IPv6 address
        valid = False
    if not valid:
        shown = repr(masked_url(value)) if isinstance(value, str) else short_repr(value)
        raise ValueError(f"expected http://host:port (port 1 to 65535, no user or password), got {shown}")
    return value.strip().rstrip("/")


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(text: str) -> str:
    return " ".join(text.split())


def check_host(host: str) -> str:
    """`server.host` must be an address the host could listen on: an IP address, or a host
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
