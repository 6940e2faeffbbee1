"""Prompt log-probabilities (vLLM's `prompt_logprobs`, what `echo` with `logprobs` reports) on the
embedded model (CPU, float32): the model's own distribution at every prompt position, whether the
prompt was cached, computed in chunks or preempted."""
from __future__ import annotations

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model

pytestmark = pytest.mark.slow

PROMPT = "The Harbor Street library opened in 1921 and holds 42,000 books. " * 3


def engine_config(tmp_path, **scheduler) -> dict:
    return {"model": {"dtype": "float32", "device": "cpu"},
            "cache": {"tiers": {"device": {"size": 64}, "cpu": {"size": 64},
                                "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}},
            "scheduler": scheduler or {"max_num_batched_tokens": 2048, "max_num_seqs": 8}}


def reference_logprobs(token_ids: list[int]) -> torch.Tensor:
    """log P(token k+1 | tokens 0..k) for every k, from one plain forward pass of the model in transformers' own
    classes, with its own attention (no paged cache, no engine)."""
    model = load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cpu", transformers_modules=True).model
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def test_prompt_logprobs_are_the_models_own_at_every_position(embedded_model_fp32, tmp_path):
    with LLM(engine_config(tmp_path), loaded_model=embedded_model_fp32) as llm:
        out, = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
    ids = out.prompt_token_ids
    expected = reference_logprobs(ids)
    assert [e.token_id for e in out.prompt_logprobs] == ids[1:]
    for k, entry in enumerate(out.prompt_logprobs):
        assert entry.logprob == pytest.approx(expected[k, ids[k + 1]].item(), abs=1e-3)
        top_values, top_ids = expected[k].topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-3)
        # its rank among the reference's tokens, up to those within the engine's rounding of it
        chosen = expected[k, ids[k + 1]]
        assert int((expected[k] > chosen + 1e-3).sum()) < entry.rank <= int((expected[k] >= chosen - 1e-3).sum())
    assert any(entry.rank > 3 for entry in out.prompt_logprobs)  # ranks beyond the alternatives reported
    assert out.logprobs is None  # only what was asked


def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_stays_cached_for_others(embedded_model_fp32,
                                                                                      tmp_path):
    with LLM(engine_config(tmp_path), loaded_model=embedded_model_fp32) as llm:
        first, = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
        scored, = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        after, = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    assert first.cached_tokens == 0 and after.cached_tokens > 0
    assert scored.cached_tokens == 0  # a cached token has no logits: every prompt token was computed
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids) - 1
    assert scored.token_ids == first.token_ids == after.token_ids


def test_chunked_and_preempted_prompts_give_each_position_once_and_the_same(embedded_model_fp32, tmp_path):
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    prompts = [f"{PROMPT} Copy {i}: {PROMPT}" for i in range(3)]
    with LLM(engine_config(tmp_path / "whole"), loaded_model=embedded_model_fp32) as llm:
        whole = llm.generate(prompts, params)
    # chunks of 32 tokens, and a device pool too small for the three at once: they preempt each other
    small = engine_config(tmp_path / "small", max_num_batched_tokens=32, max_num_seqs=3)
    small["cache"]["tiers"]["device"]["size"] = 2 * (len(whole[0].prompt_token_ids) + params.max_tokens) // 16
    with LLM(small, loaded_model=embedded_model_fp32) as llm:
        chunked = llm.generate(prompts, params)
    assert any(o.num_preemptions for o in chunked), "the pool was meant to be too small for all three at once"
    for a, b in zip(whole, chunked):
        assert [e.token_id for e in b.prompt_logprobs] == a.prompt_token_ids[1:]
        assert [e.logprob for e in b.prompt_logprobs] == pytest.approx([e.logprob for e in a.prompt_logprobs],
                                                                       abs=1e-3)


def test_a_scored_prefix_is_not_recomputed_to_score_what_follows_it(embedded_model_fp32, tmp_path):
    # lm-evaluation-harness's multiple choice on a document: the same context, scored with each answer
    context = "Document: " + PROMPT * 3 + "Question: When did the library open? Answer:"
    answers = [" In 1921.", " In 1987.", " It has not opened."]
    with LLM(engine_config(tmp_path), loaded_model=embedded_model_fp32) as llm:
        scored = [llm.generate(context + a, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))[0]
                  for a, k in zip(answers, (2, 2, 5))]
        stats = llm.stats()["prompt_logprob_cache"]
    full_blocks = (len(scored[0].prompt_token_ids) - 1) // 16
    assert scored[0].cached_tokens == 0
    for out in scored[1:]:
        # every block of the shared context but its last, whose last position predicts the first token after it
        assert out.cached_tokens >= (full_blocks - 3) * 16 and out.cached_tokens_by_tier["device"] == out.cached_tokens
    assert stats["blocks_served"] >= 2 * (full_blocks - 3) and stats["blocks"] >= full_blocks
    for out, k in zip(scored, (2, 2, 5)):
        ids = out.prompt_token_ids
        expected = reference_logprobs(ids)
        assert [e.token_id for e in out.prompt_logprobs] == ids[1:]
        assert [e.logprob for e in out.prompt_logprobs] == pytest.approx(
            expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(), abs=1e-3)
        assert all(len(e.top) == k for e in out.prompt_logprobs)
        assert [t for t, _ in out.prompt_logprobs[-1].top] == expected[-1].topk(k).indices.tolist()
