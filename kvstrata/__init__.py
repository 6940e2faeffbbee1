"""kvstrata: an LLM inference engine with a tiered prefix KV cache (device / pinned CPU / LMDB disk / remote).

`kvstrata.engine`, `.tiers` and `.kernels` live in the repository's top-level folders of those names. They are
namespace packages (no `__init__.py`), so from the repository root an installed package of the same name (Hugging
Face's `kernels`, which transformers imports) still wins over our folder. In a checkout the links
`kvstrata/engine -> ../engine` (and tiers, kernels) make them subpackages here; a wheel maps them by pyproject's
package-dir."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestFailedError", "load_config",
           "__version__"]


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
