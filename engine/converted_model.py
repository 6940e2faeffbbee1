"""The embedded model converted once: its GGUF's tokenizer and weights as transformers saves them, so that later
starts skip the conversion.

Loading a GGUF through transformers parses its metadata three times (for the config, the tokenizer and the weights:
some 440,000 fields, the vocabulary's strings one by one), dequantises every tensor and converts the tokenizer: most
of a start's time. A converted copy is plain safetensors and a tokenizer.json.

Copies live in the user's cache directory (engine/model_identity.py `cache_root`), private to the user, under
`converted/<the GGUF's content digest>-transformers<version>/`: `tokenizer/`, and one folder per dtype of weights
(`float32/`, `bfloat16/`, ...), each holding what transformers made of the GGUF in that dtype, so that a copy loads
to the same bits as the GGUF does (a float32 copy cast at load time would not: the GGUF path builds some buffers in
the model's dtype and others in float32). Keyed by the GGUF's content and the transformers version that converted it,
a copy is never used for another file or another conversion.

A copy is derived data and never trusted blindly: each folder is written in a temporary folder and renamed into place
whole, with `manifest.json`, the digest of each of its files, written last; a load checks every digest first (cheap
beside the conversion it saves, with the weights in the page cache). A copy that is missing, half written, damaged on
disk or fails to load is a miss: the GGUF is read as before and the copy written again. A copy that cannot be
written (a read-only or full disk) is left out, with one warning.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

from kvstrata.engine.model_identity import cache_root, digest_file

logger = logging.getLogger("kvstrata")

_T = TypeVar("_T")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def converted_dir(identity: str) -> Path:
    """Where the copies of the model named `identity` (`<name>@xxh3_128:<hex>`, engine/model_identity.py) live."""
    import transformers

    digest = identity.rpartition(":")[2]
    return cache_root() / "converted" / f"{digest}-transformers{transformers.__version__}"


def load_or_convert(directory: Path, load_copy: Callable[[Path], _T], convert: Callable[[], _T],
                    save: Callable[[_T, Path], None], read_back: bool = False) -> _T:
    """`load_copy(directory)` when `directory` holds a whole, undamaged copy; else `convert()`, whose result is saved
    there (`save(result, folder)`) for the next time. With `read_back`, a conversion whose copy is then in place is let
    go and the copy loaded instead, so that a first start gets what every later start gets (and a large result is
    never held twice)."""
    if _verified(directory):
        try:
            return load_copy(directory)
        except Exception as exc:  # noqa: BLE001 - a copy that fails to load is a miss, converted again
            logger.warning("kvstrata: the converted copy in %s did not load (%s); converting the model again",
                           directory, first_line(exc))
    value = convert()
    if _write(directory, lambda folder: save(value, folder)) and read_back:
        del value
        gc.collect()
        return load_copy(directory)
    return value


def _verified(directory: Path) -> bool:
    """The folder holds a manifest of this format whose every file is there with its digest."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("version") != FORMAT_VERSION or not isinstance(files, dict) or not files:
        return False
    for name, digest in files.items():
        try:
            if digest_file(directory / name) != digest:
                logger.warning("kvstrata: the converted copy in %s is damaged (%s); converting the model again",
                               directory, name)
                return False
        except OSError:
            return False
    return True


def _write(directory: Path, save: Callable[[Path], None]) -> bool:
    """Save into a private temporary folder beside `directory`, write its manifest last, then rename it into place
    (replacing a damaged copy). Another process that renamed its own copy first wins; a failure leaves nothing.
    Whether a whole copy is in place after it."""
    temp = None
    try:
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))  # mode 0700
        save(temp)
        files = {p.name: digest_file(p) for p in sorted(temp.iterdir()) if p.is_file()}
        (temp / MANIFEST).write_text(json.dumps({"version": FORMAT_VERSION, "files": files}), encoding="utf-8")
        if directory.exists() and not _verified(directory):
            shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rename(temp, directory)
            temp = None
        except OSError:
            if not _verified(directory):  # not another process's whole copy: ours could not be put there
                raise
        return True
    except Exception as exc:  # noqa: BLE001 - the copy is an optimisation: the model is loaded either way
        logger.warning("kvstrata: could not keep a converted copy of the model in %s (%s); the next start converts "
                       "it again", directory, first_line(exc))
        return False
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line only (for a one-line error or warning); a first line that ends in a
    colon introduces what follows, which is then kept too, on the same line and cut short."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if not lines[0].endswith(":") or len(lines) == 1:
        return lines[0]
    rest = " ".join(lines[1:])
    return f"{lines[0]} {rest if len(rest) <= 200 else rest[:197] + '...'}"
