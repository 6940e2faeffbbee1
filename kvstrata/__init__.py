"""kvstrata: an LLM inference engine with a tiered prefix KV cache (device / pinned CPU / LMDB disk)."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "load_config", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kvstrata` (e.g. for `kvstrata config check`) must not pay for torch/transformers.
    if name in ("LLM", "RequestOutput"):
        from kvstrata.engine import llm
        return getattr(llm, name)
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
