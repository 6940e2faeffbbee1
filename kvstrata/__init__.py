"""kvstrata: an LLM inference engine with a tiered prefix KV cache (device / pinned CPU / LMDB disk)."""
from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestFailedError", "load_config",
           "__version__"]


def _find_subpackages_in_checkout() -> None:
    """Imported from a checkout (`PYTHONPATH=.`, or a checkout's folder shadowing an install elsewhere on the path,
    as `python -m pytest` run in it does), `kvstrata.engine`, `.tiers` and `.kernels` are the checkout's top-level
    folders, as pyproject's package-dir maps them in an install. An installed copy has its own beside it."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "engine" / "__init__.py").is_file() \
            and not (Path(__file__).parent / "engine").is_dir():
        __path__.append(str(root))


_find_subpackages_in_checkout()


def __getattr__(name: str):
    # Lazy: `import kvstrata` (e.g. for `kvstrata config check`) must not pay for torch/transformers.
    if name == "LLM":
        from kvstrata.llm import LLM
        return LLM
    if name == "RequestOutput":
        from kvstrata.engine.llm import RequestOutput
        return RequestOutput
    if name == "RequestFailedError":
        from kvstrata.engine.request import RequestFailedError
        return RequestFailedError
    if name == "SamplingParams":
        from kvstrata.engine.sampling import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvstrata.engine.structured_outputs import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "load_config":
        from kvstrata.engine.config import load_config
        return load_config
    raise AttributeError(name)
