"""Tier sizes as users write them in YAML: a byte size ("512MiB", "1.5GB") or a block count (1024).

A byte size cannot be turned into blocks until the model is known (a block's byte size depends on
the model's layers, KV heads, head size and dtype), so a `Size` keeps what the user wrote and the
engine converts it with `to_blocks(block_nbytes)` once the model is loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

# Decimal units are powers of 1000, binary units powers of 1024; units match case-insensitively.
_UNITS = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "KiB", "MiB", "GiB", "TiB", "PiB")
_SIZE_RE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")
_HOW = "expected a byte size such as '512MiB' or '1.5GB', a block count such as 1024, or 0 for off"


@dataclass(frozen=True)
class Size:
    """What a user gave for a tier size: exactly one of `nbytes` or `num_blocks` is set.

    Zero (either way) means the tier is off.
    """

    nbytes: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.num_blocks is None):
            raise ValueError("a Size holds either a byte count or a block count")
        if (self.nbytes or 0) < 0 or (self.num_blocks or 0) < 0:
            raise ValueError("a Size cannot be negative")

    @classmethod
    def parse(cls, value: Any) -> Size:
        """Parse a YAML value: "8GiB", "1.5GB", "100 MB", "4KiB", 1024 or "1024" (blocks), 0 (off).

        Raises ValueError (one line, naming the value) for anything else.
        """
        if isinstance(value, Size):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            if isinstance(value, float):
                raise ValueError(f"bad size {value!r}: a block count must be a whole number; "
                                 "add a unit (e.g. '1.5GiB') for a byte size")
            raise ValueError(f"bad size {value!r}: {_HOW}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"bad size {value}: must not be negative")
            return cls(num_blocks=value)
        return cls._parse_text(value)

    @classmethod
    def _parse_text(cls, text: str) -> Size:
        match = _SIZE_RE.match(text)
        if match is None:
            raise ValueError(f"bad size {text!r}: {_HOW}")
        number, unit = match["number"], match["unit"]
        if not unit:
            if "." in number:
                raise ValueError(f"bad size {text!r}: a block count must be a whole number; "
                                 "add a unit (e.g. '1.5GiB') for a byte size")
            return cls(num_blocks=int(number))
        multiplier = _UNITS.get(unit.lower())
        if multiplier is None:
            raise ValueError(f"unknown unit {unit!r} in size {text!r} (expected one of {', '.join(_UNIT_NAMES)})")
        try:
            nbytes = int(Decimal(number) * multiplier)  # "1.5GB" is exact in Decimal; a fraction of a byte is dropped
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only plain decimals
            raise ValueError(f"bad size {text!r}: {_HOW}") from exc
        return cls(nbytes=nbytes)

    @property
    def is_off(self) -> bool:
        """True when the size is zero: the tier it sizes does not exist."""
        return (self.nbytes or 0) == 0 and (self.num_blocks or 0) == 0

    @property
    def is_bytes(self) -> bool:
        return self.nbytes is not None

    def to_blocks(self, block_nbytes: int) -> int:
        """How many whole blocks of `block_nbytes` this size holds (0 if it is smaller than one block)."""
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be positive, got {block_nbytes}")
        if self.num_blocks is not None:
            return self.num_blocks
        return self.nbytes // block_nbytes

    def to_bytes(self, block_nbytes: int) -> int:
        """The bytes this size stands for: a block count times `block_nbytes`, or the byte size itself."""
        if self.nbytes is not None:
            return self.nbytes
        return self.num_blocks * block_nbytes

    def to_yaml_value(self) -> int | str:
        """The value to write back into YAML such that `Size.parse` gives this Size again."""
        return self.num_blocks if self.num_blocks is not None else format_size(self.nbytes)

    def __str__(self) -> str:
        if self.num_blocks is not None:
            return f"{self.num_blocks} blocks"
        return format_size(self.nbytes)


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of a byte count: 1073741824 -> "1GiB", 1500000000 -> "1500MB"."""
    if nbytes == 0:
        return "0B"
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB", "PB", "TB", "GB", "MB", "KB"):
        multiplier = _UNITS[unit.lower()]
        if nbytes % multiplier == 0:
            return f"{nbytes // multiplier}{unit}"
    return f"{nbytes}B"

