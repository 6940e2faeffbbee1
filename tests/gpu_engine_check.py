"""Greedy fp32 outputs of the embedded model on the GPU, with the compiled Triton kernels: with prefix caching off,
and with a document's prefix served from the device and from the CPU tier; and three questions on a cached document
answered at once with steps replayed as CUDA graphs (`model.cuda_graphs`: the step of their three questions, then
their decodes) and without. Prints one JSON object. Needs CUDA and TRITON_INTERPRET unset; tests/test_engine_cuda.py
runs it:

    python tests/gpu_engine_check.py
"""
from __future__ import annotations

import json
import os

import torch
from pydoc_data.topics import topics

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
DOCUMENT = topics["try"][:3000]  # ~700 tokens: dozens of blocks
QUESTIONS = ("What is this section about?", "Name one keyword it explains.", "What does finally do?")


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{DOCUMENT}\n\nQuestion: {question}"}]


def config(caching: bool, cuda_graphs: bool = False):
    # always_load: on a GPU the `auto` policy may rightly recompute a short document rather than load it (one H200
    # recomputed every CPU-tier hit of SmolLM2's: a step costs the host's time whatever its tokens), and the check
    # is of what a tier's blocks give, so it must read them
    return load_config({"model": {"dtype": "float32", "device": "cuda", "cuda_graphs": cuda_graphs},
                        "cache": {"enable_prefix_caching": caching, "offload": "write_through",
                                  "load_policy": "always_load",
                                  "tiers": {"device": {"size": 256}, "cpu": {"size": 256}}}})


def answer(llm: LLM, question: str) -> dict:
    out = llm.chat(chat(question), GREEDY)[0]
    return {"token_ids": out.token_ids, "cached_tokens_by_tier": out.cached_tokens_by_tier}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET to run compiled kernels"
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    loaded = load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cuda")
    with LLM(config(caching=False), loaded_model=loaded) as llm:
        uncached = {q: answer(llm, q) for q in QUESTIONS[1:]}
    with LLM(config(caching=True), loaded_model=loaded) as llm:
        answer(llm, QUESTIONS[0])  # the document is computed, cached on the device and written through
        device_hit = answer(llm, QUESTIONS[1])
        llm.engine.hierarchy.wait_for_write_downs()
        assert llm.engine.hierarchy.clear_device_cache(), "a device block is still in use"
        cpu_hit = answer(llm, QUESTIONS[2])
        backend = llm.engine.attention_backend
    graphs = {}
    for cuda_graphs in (False, True):
        with LLM(config(caching=True, cuda_graphs=cuda_graphs), loaded_model=loaded) as llm:
            answer(llm, QUESTIONS[0])  # the document, computed eagerly (more tokens than a graph's size)
            # the three questions over the cached document in one step (a size of (64, 4) with graphs), then
            # their decodes together (4, 4)
            outs = llm.chat([chat(q) for q in QUESTIONS], GREEDY)
            graphs[str(cuda_graphs).lower()] = {"token_ids": [o.token_ids for o in outs],
                                                "recorded_sizes": sorted(llm.engine.runner.recorded_graph_sizes)}
    print(json.dumps({"attention_backend": backend, "cuda_graphs": graphs,
                      "device": {"uncached": uncached[QUESTIONS[1]], "cached": device_hit},
                      "cpu": {"uncached": uncached[QUESTIONS[2]], "cached": cpu_hit}}))


if __name__ == "__main__":
    main()
