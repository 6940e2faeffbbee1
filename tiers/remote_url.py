"""The remote tier's server address: checked and shown without its password; and the tier's write-queue default.

A URL is `redis://[[user]:password@]host[:port][/db]` or `rediss://...` (TLS), as the `redis` client
reads it; Valkey answers both. The password (an ACL user's, or the default user's) must never reach
a log line, an error message, `/metrics` or `kvstrata config check`: everything that shows a URL
shows `masked_url(url)`, and `check_url` never echoes the URL it refuses.

Cheap to import (no torch, no client library): config validation uses it.
"""
from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

SECRET_MASK = "********"
URL_SCHEMES = ("redis", "rediss")

# Bytes of records waiting for the remote tier's writer (or in its round trip); beyond this, puts are dropped. A
# burst must fit: a long document is written through as fast as it is computed (on a GPU, faster than a server
# takes it), and a chain that loses a block is found only as far as that block by every replica. One 8k-token
# prompt of a Llama-3-8B-shaped model is 1 GiB of bf16 records; the memory is used only while the writer is behind.
DEFAULT_QUEUE_BYTES = 1 << 30

_QUERY_PASSWORD = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


def masked_url(url: str) -> str:
    """`url` with its passwords (the `user:password@` one, and any `password=` of its query, which the `redis`
    client reads too) replaced by `SECRET_MASK`; anything unparsable is masked whole. Any scheme: an HTTP URL
    given with credentials is shown the same way."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            netloc = f"{parts.username or ''}:{SECRET_MASK}@{netloc.rpartition('@')[2]}"
        query = _QUERY_PASSWORD.sub(rf"\1{SECRET_MASK}", parts.query)
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        return parts._replace(netloc=netloc, query=query).geturl()
    except ValueError:
        return SECRET_MASK


def scrub(text: str, url: str) -> str:
    """`text` (an error message from the client, say) with the URL's passwords masked out of it."""
    try:
        parts = urlsplit(url)
        passwords = [parts.password, *(value for key, value in parse_qsl(parts.query) if key.lower() == "password")]
    except ValueError:
        return text
    for password in filter(None, passwords):
        for spelled in {password, unquote(password), quote(password, safe="")}:
            text = text.replace(spelled, SECRET_MASK)
    return text


def check_url(url: str, cluster: bool = False) -> str:
    """Raise ValueError (one line, the URL masked) unless `url` is one the remote tier can use.

    A cluster has a single database, 0: a URL naming another one is refused for it.
    """
    shown = masked_url(url)
    try:
        parts: SplitResult = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"cannot parse {shown!r}: {exc}") from None
    if parts.scheme not in URL_SCHEMES:
        raise ValueError(f"{shown!r}: expected a redis:// or rediss:// (TLS) URL")
    if not parts.hostname:
        raise ValueError(f"{shown!r}: no host")
    if port == 0:
        raise ValueError(f"{shown!r}: port 0 is no server's port")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{shown!r}: the path must be a database number such as /0, got /{db}")
    if cluster and db not in ("", "0"):
        raise ValueError(f"{shown!r}: a cluster has only database 0")
    return url.strip()
