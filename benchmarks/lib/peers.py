"""The systems kvstrata is compared with, on the same prompts (token ids) and the same model file.

- `HFGeneratePeer`: what a user without kvstrata runs: Hugging Face transformers' `generate` with
  `max_new_tokens=1`, one request at a time, no KV reuse between requests, the model's default
  attention, the same GGUF dequantised to the same dtype.
- `LlamaCppPeer`: llama-cpp-python on the same GGUF with its prompt cache, `LlamaRAMCache` or
  `LlamaDiskCache`. Calls are non-streaming: a streamed call was seen not to store its prompt-cache
  state. TTFT is the latency of a `max_tokens=1` call (which includes saving the state).

Each peer answers `first_token_latency(token_ids) -> seconds` and `close()`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import time
from pathlib import Path
from typing import Sequence

LLAMA_CPP_MISSING = ("llama-cpp-python is not installed (pip install 'kvstrata[peers]'; it compiles "
                     "llama.cpp on install)")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class HFGeneratePeer:
    """transformers `generate(max_new_tokens=1)` per request: every prompt is prefilled in full."""

    name = "hf_generate"

    def __init__(self, model_dir: Path, gguf_file: str | None, dtype):
        os.environ["HF_HUB_OFFLINE"] = "1"
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        files = {"local_files_only": True}
        if gguf_file:
            files["gguf_file"] = gguf_file
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **files).eval()
        self.attention = self.model.config._attn_implementation
        eos = self.model.generation_config.eos_token_id
        self._pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos

    def first_token_latency(self, token_ids: Sequence[int]) -> float:
        torch = self._torch
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False,
                                pad_token_id=self._pad_token_id)
        return time.perf_counter() - start

    def close(self) -> None:
        del self.model


class LlamaCppPeer:
    """llama-cpp-python with a prompt cache: `cache_kind` "ram" (LlamaRAMCache) or "disk" (LlamaDiskCache)."""

    def __init__(self, gguf_path: Path, cache_kind: str, n_ctx: int, n_threads: int,
                 cache_dir: Path | None = None, capacity_bytes: int = 2 << 30):
        from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache

        if cache_kind not in ("ram", "disk"):
            raise ValueError(f"llama.cpp cache kind must be 'ram' or 'disk', got {cache_kind!r}")
        self.name = f"llama_cpp_{cache_kind}_cache"
        self.cache_dir = cache_dir
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=n_threads, verbose=False)
        if cache_kind == "ram":
            cache = LlamaRAMCache(capacity_bytes=capacity_bytes)
        else:
            if cache_dir is None:
                raise ValueError("llama.cpp disk cache needs a cache_dir")
            cache = LlamaDiskCache(cache_dir=str(cache_dir), capacity_bytes=capacity_bytes)
        self.llm.set_cache(cache)

    def first_token_latency(self, token_ids: Sequence[int]) -> float:
        # LlamaDiskCache prints three debug lines to stderr on every store: keep them out of the log
        with contextlib.redirect_stderr(io.StringIO()):
            start = time.perf_counter()
            self.llm.create_completion(prompt=list(token_ids), max_tokens=1, temperature=0.0, stream=False)
            return time.perf_counter() - start

    def cache_bytes(self) -> int:
        """Bytes the prompt cache holds now (states of every prompt it stored, as llama-cpp-python keeps them)."""
        return int(self.llm.cache.cache_size) if self.llm.cache is not None else 0

    def close(self) -> None:
        self.llm.close()
