"""Binding a listening socket before anything slow starts, shared by `kvstrata serve` and `kvstrata route`:
a port in use or a host that does not resolve is reported in one line before a model or tokenizer loads."""
from __future__ import annotations

import errno
import socket


def bind_socket(host: str, port: int, key: str = "server") -> socket.socket:
    """A socket bound to (host, port), so a port in use is reported before the model loads. Errors
    name `key.host` / `key.port`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"{key}.host: cannot resolve {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise _socket_error(exc, host, port, key) from None
    return sock


def listen(sock: socket.socket, key: str = "server") -> None:
    """Start listening on a socket from `bind_socket`. The bind shares its port with any other socket that set
    SO_REUSEADDR (so that a restart need not wait for old connections' TIME_WAIT) and is not listening yet, such as
    another server still loading its model: whichever listens second fails here, in the same one line."""
    try:
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        host, port = sock.getsockname()[:2]
        raise _socket_error(exc, host, port, key) from None


def _socket_error(exc: OSError, host: str, port: int, key: str) -> ValueError:
    if exc.errno == errno.EADDRINUSE:
        return ValueError(f"{key}.port: {host}:{port} is already in use (choose another with --port)")
    return ValueError(f"{key}.host: cannot listen on {host}:{port}: {exc.strerror}")
