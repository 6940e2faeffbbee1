"""Requests through the engine on the embedded model (CPU, float32): what a refused request leaves
behind, the log-probabilities that come with the tokens, and the figures left after close."""
from __future__ import annotations

import pytest

from kvstrata import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours of light are"


@pytest.fixture
def llm(embedded_model_fp32, tmp_path):
    config = {"model": {"dtype": "float32", "device": "cpu"},
              "cache": {"tiers": {"device": {"size": 64}, "cpu": {"size": 64},
                                  "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}}}
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        yield llm


def test_a_request_refused_while_being_added_leaves_nothing_behind(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=2)
    params.seed = 2**64  # past validation, as a caller mutating params could: the generator refuses it
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        engine.add_request("refused", engine.tokenize(PROMPT), params)
    assert engine.requests == {}
    assert not engine.has_unfinished_requests()
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids  # still serving


def test_greedy_logprobs_name_each_generated_token_as_the_likeliest(llm):
    plain, = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0))
    with_logprobs, = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    assert plain.logprobs is None
    assert with_logprobs.token_ids == plain.token_ids  # asking for logprobs changes no token
    assert [entry.token_id for entry in with_logprobs.logprobs] == plain.token_ids
    for entry in with_logprobs.logprobs:
        assert len(entry.top) == 3
        assert entry.top[0] == (entry.token_id, entry.logprob)
        assert entry.logprob <= 0 and [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def test_stats_after_close_report_what_writing_down_did(llm):
    llm.generate(PROMPT * 4, SamplingParams(max_tokens=1, temperature=0.0))
    llm.close()
    disk = llm.stats()["tiers"]["disk"]
    assert disk["used_blocks"] > 0 and disk["extra"]["pending_puts"] == 0
    assert disk["extra"]["write_errors"] == 0
