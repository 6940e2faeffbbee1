"""A model's identity: a digest of the content of every file that decides what its KV blocks hold.

The identity is folded into every hash namespace, so two models never share a cached block. It
must change whenever the weights change, even when a re-saved file keeps its name and size (a
fine-tune written over its base), and with the tokenizer and chat template, which decide the token
ids that blocks are keyed by. So it digests file content, which for a large model is slow (all of
its bytes); each file's digest is therefore kept in a small JSON file in the user's cache directory
(`$KVSTRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstrata`, else `~/.cache/kvstrata`), keyed by the
file's path, size and modification time (and its inode and status-change time, which a rewrite
changes even when it restores the modification time), so that a restart costs a `stat` per file.

The cache is an optimisation only: a missing, unreadable or damaged cache file means digesting
again, and a cache directory that cannot be written is left alone.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

DIGEST = "xxh3_128"
_CHUNK_BYTES = 8 << 20
_CACHE_FILE = "file_digests.json"
_CACHE_VERSION = 1
_MAX_CACHED_FILES = 1024  # a few dozen models' files; the oldest entries are dropped beyond it

# Files of a model directory that decide its KV blocks: the architecture, the weights (and their
# shard indexes), and the tokenizer and chat template (token ids are what blocks are keyed by).
# Other files (README, generation settings) change no block.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")

_lock = threading.Lock()


@dataclass(frozen=True)
class _Stat:
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int


def directory_identity(display_name: str, directory: Path) -> str:
    """`<display name>@xxh3_128:<hex>` over the name and content of the directory's identity files."""
    files = identity_files(directory)
    digests = file_digests(files)
    combined = xxhash.xxh3_128()
    for path in files:
        combined.update(f"{path.name}\0{digests[path]}\0".encode())
    return f"{display_name}@{DIGEST}:{combined.hexdigest()}"


def file_identity(display_name: str, path: Path) -> str:
    """`<display name>@xxh3_128:<hex>` over one file's content (a GGUF holds weights and tokenizer)."""
    return f"{display_name}@{DIGEST}:{file_digests([path])[path]}"


def identity_files(directory: Path) -> list[Path]:
    """The files of a model directory that its identity digests, sorted by name."""
    chosen = []
    for path in directory.iterdir():
        name = path.name
        if not path.is_file():
            continue
        if (name == "config.json" or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
                or name.startswith(_TOKENIZER_PREFIXES)):
            chosen.append(path)
    return sorted(chosen, key=lambda p: p.name)


def file_digests(paths: list[Path]) -> dict[Path, str]:
    """Each file's content digest, from the cache where its path, size and mtime still match."""
    with _lock:  # one process digests a file once, and never writes the cache file concurrently
        cache = _read_cache()
        digests, changed = {}, False
        for path in paths:
            key, stat = str(path.resolve()), _stat(path)
            entry = cache.get(key)
            if entry is not None and entry.get("stat") == asdict(stat):
                digests[path] = entry["digest"]
                continue
            digests[path] = digest_file(path)
            cache.pop(key, None)  # re-inserted last: the newest entries are the ones kept
            cache[key] = {"stat": asdict(stat), "digest": digests[path]}
            changed = True
        if changed:
            _write_cache(cache)
    return digests


def cache_root() -> Path:
    """The user's cache directory for kvstrata: `$KVSTRATA_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstrata`, else
    `~/.cache/kvstrata`."""
    root = os.environ.get("KVSTRATA_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "kvstrata")
    return Path(root)


def digest_cache_path() -> Path:
    return cache_root() / _CACHE_FILE


def _stat(path: Path) -> _Stat:
    stat = path.stat()
    return _Stat(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def digest_file(path: Path) -> str:
    """The xxh3_128 hex digest of a file's content, read in chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_cache() -> dict[str, dict]:
    try:
        data = json.loads(digest_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION or not isinstance(data.get("files"), dict):
        return {}
    return {key: entry for key, entry in data["files"].items()
            if isinstance(entry, dict) and isinstance(entry.get("digest"), str)}


def _write_cache(cache: dict[str, dict]) -> None:
    """Replace the cache file atomically (another process may read it meanwhile); newest entries kept."""
    entries = list(cache.items())[-_MAX_CACHED_FILES:]
    path = digest_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{_CACHE_FILE}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": _CACHE_VERSION, "files": dict(entries)}, f)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError:
        pass  # no cache this time: the next start digests again
