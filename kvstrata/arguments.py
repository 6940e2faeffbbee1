"""argparse value types the command line, the planner and the benchmarks share (a module of its own: the command
line imports the planner, so neither can hold them for the other)."""
from __future__ import annotations

import argparse


class IntAtLeast:
    """An argparse type: an integer of at least `minimum`. argparse names the type by its `__name__` when the text
    is no integer at all ("invalid positive integer value: 'abc'"), so it carries a name a user can read."""

    def __init__(self, minimum: int, name: str):
        self.minimum = minimum
        self.__name__ = name

    def __call__(self, text: str) -> int:
        value = int(text)
        if value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be a {self.__name__}, got {value}")
        return value


positive_int = IntAtLeast(1, "positive integer")
non_negative_int = IntAtLeast(0, "non-negative integer")
