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


@pytest.mark.parametrize("token_id", [-1, 49152, 1.5, "7", None])
def test_a_prompt_token_id_outside_the_vocabulary_or_not_an_integer_is_refused_in_one_line(llm, token_id):
    engine = llm.engine
    ids = [*engine.tokenize(PROMPT) * 200, token_id]  # a long prompt, its bad id last
    with pytest.raises(ValueError, match=r"^prompt token ids must be integers in \[0, 49152\)$"):
        engine.validate_request(ids, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt token ids must be integers in \[0, 49152\)$"):
        engine.add_request("refused", ids, SamplingParams(max_tokens=2))
    assert engine.requests == {}


def test_prompt_token_ids_of_any_integer_type_become_ints_and_an_empty_prompt_is_refused(llm):
    import numpy as np

    engine = llm.engine
    ids = engine.tokenize(PROMPT)
    request = engine.add_request("numpy", np.array(ids, dtype=np.int32), SamplingParams(max_tokens=1))
    assert request.prompt_token_ids == ids and all(type(t) is int for t in request.prompt_token_ids)
    engine.abort_request("numpy")
    for empty in ([], (), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match="^prompt is empty$"):
            engine.add_request("empty", empty, SamplingParams(max_tokens=1))
    assert "empty" not in engine.requests


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


def test_stop_token_ids_min_tokens_and_logit_bias_steer_generation(llm):
    greedy = dict(max_tokens=8, temperature=0.0)
    full, = llm.generate(PROMPT, SamplingParams(**greedy))
    stop = full.token_ids[2]
    cut, = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[stop]))
    end = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:end + 1] and cut.finish_reason == "stop" and cut.stop_reason == stop
    before_stop, = llm.generate(PROMPT, SamplingParams(max_tokens=end, temperature=0.0))
    assert cut.text == before_stop.text  # the stop token's own text is not in the answer
    # min_tokens: a stop token cannot end (or start) the answer before that many tokens are out
    first = full.token_ids[0]
    held, = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[first], min_tokens=3))
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    # logit_bias makes the end of sequence the likeliest token: it ends the answer right after min_tokens
    eos = min(llm.engine.loaded.model_config.eos_token_ids)
    ended, = llm.generate(PROMPT, SamplingParams(**greedy, logit_bias={eos: 100}, min_tokens=4))
    assert len(ended.token_ids) == 5 and ended.token_ids[-1] == eos and ended.finish_reason == "stop"
    assert eos not in ended.token_ids[:4]


def test_the_stop_string_or_token_that_ended_an_answer_is_kept_when_asked_for(llm):
    greedy = dict(max_tokens=8, temperature=0.0)
    full, = llm.generate(PROMPT, SamplingParams(**greedy))
    stop_text = full.text.strip()[3:7]
    cut, = llm.generate(PROMPT, SamplingParams(**greedy, stop=stop_text))
    kept, = llm.generate(PROMPT, SamplingParams(**greedy, stop=stop_text, include_stop_str_in_output=True))
    assert cut.stop_reason == kept.stop_reason == stop_text and cut.token_ids == kept.token_ids
    assert kept.text == cut.text + stop_text and full.text.startswith(kept.text)
    stop_token = full.token_ids[2]
    kept, = llm.generate(PROMPT, SamplingParams(**greedy, stop_token_ids=[stop_token], include_stop_str_in_output=True))
    upto, = llm.generate(PROMPT, SamplingParams(max_tokens=full.token_ids.index(stop_token) + 1, temperature=0.0))
    assert kept.stop_reason == stop_token and kept.text == upto.text


def test_special_tokens_show_in_the_text_when_not_skipped(llm):
    eos = min(llm.engine.loaded.model_config.eos_token_ids)
    eos_text = llm.engine.tokenizer.decode([eos])
    params = dict(max_tokens=3, temperature=0.0, logit_bias={eos: 100}, ignore_eos=True)
    skipped, = llm.generate(PROMPT, SamplingParams(**params))
    shown, = llm.generate(PROMPT, SamplingParams(**params, skip_special_tokens=False))
    assert skipped.token_ids == shown.token_ids == [eos] * 3
    assert skipped.text == "" and shown.text == eos_text * 3


def test_presence_and_frequency_penalties_see_the_tokens_generated_so_far(llm):
    # Both penalties shift a row's logits per token, so the greedy choice they make can be checked
    # against the raw log-probabilities reported with each token.
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=20, presence_penalty=0.5, frequency_penalty=1.0)
    out, = llm.generate(PROMPT, params)
    plain, = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    assert out.token_ids != plain.token_ids  # the penalties changed the answer
    counts: dict[int, int] = {}
    for entry in out.logprobs:
        penalised = {t: lp - (0.5 + 1.0 * counts[t] if t in counts else 0.0) for t, lp in entry.top}
        assert entry.token_id == max(penalised, key=penalised.get)
        counts[entry.token_id] = counts.get(entry.token_id, 0) + 1


def test_a_repetition_penalty_steers_away_from_the_prompt_and_leaves_nothing_behind(llm):
    prompt = "red green blue red green blue red green blue red green"
    plain, = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    penalised, = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=2.0))
    assert penalised.token_ids != plain.token_ids
    assert llm.engine._penalised_prompts == {}  # the prompt kept for the penalty went with the request


def test_n_sequences_of_a_prompt_come_in_one_output_each_as_its_seed_samples_it_alone(llm):
    prompt = f"{PROMPT} red, green and blue. In a village by the sea, once upon a time, there lived"
    (out,) = llm.generate(prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, logprobs=0))
    assert [s.index for s in out.outputs] == [0, 1, 2]
    # the prompt is computed once: the two other sequences find its full blocks on the device
    full_blocks = (len(out.prompt_token_ids) - 1) // 16 * 16
    assert full_blocks > 0 and llm.stats()["prefix_cache"]["hit_tokens"]["device"] == 2 * full_blocks
    alone = [llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i))[0] for i in range(3)]
    assert [s.token_ids for s in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    for sequence in out.outputs:
        assert sequence.finish_reason == "length" and len(sequence.logprobs) == 6
        assert sequence.cumulative_logprob == pytest.approx(sum(e.logprob for e in sequence.logprobs))
    assert alone[0].outputs[0].cumulative_logprob is None  # no logprobs asked for
    assert out.num_cached_tokens == out.cached_tokens


def test_a_batch_with_n_answers_one_output_per_prompt_in_order_and_refuses_n_per_engine_request(llm):
    outs = llm.generate([PROMPT, "Two plus two is"], [SamplingParams(n=2, max_tokens=3, temperature=0.0),
                                                      SamplingParams(max_tokens=3, temperature=0.0)])
    assert [len(o.outputs) for o in outs] == [2, 1]
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids  # greedy: the same sequence twice
    assert outs[1].token_ids == llm.generate("Two plus two is", SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    with pytest.raises(ValueError, match="n must be 1 for one engine request"):
        llm.engine.add_request("n2", llm.engine.tokenize(PROMPT), SamplingParams(n=2))
    assert llm.engine.requests == {}


@pytest.mark.parametrize("offload_answers", [False, True])
def test_an_answer_goes_below_the_device_only_once_a_later_prompt_reuses_it_unless_offload_answers(
        embedded_model_fp32, offload_answers):
    """`cache.offload_answers` off (the default): an answer's blocks are not in the CPU tier after it is generated,
    so a chat's next turn after the device is reset finds only the first prompt below; a next turn that reuses the
    answer from the device writes it down. On: the answer goes down as it is generated."""
    config = {"model": {"dtype": "float32", "device": "cpu"},
              "cache": {"block_size": 16, "offload_answers": offload_answers, "load_policy": "always_load",
                        "tiers": {"device": {"size": 64}, "cpu": {"size": 64}}}}
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    one_token = SamplingParams(max_tokens=1)
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        def chat(text: str) -> tuple[list[int], int, int]:
            """A first turn answered; the next turn's prompt, and the blocks of the first prompt and the answer."""
            prompt = llm.engine.tokenize(text)
            answer = llm.generate(prompt, greedy)[0].token_ids
            prompt_blocks = len(prompt) // 16
            answer_blocks = (len(prompt) + len(answer) - 1) // 16 - prompt_blocks  # the last token is never fed back
            return [*prompt, *answer, *llm.engine.tokenize(" Name one more.")], prompt_blocks, answer_blocks

        turn, prompt_blocks, answer_blocks = chat(PROMPT * 3)
        assert llm.reset_prefix_cache()
        below = llm.generate(turn, one_token)[0].cached_tokens_by_tier
        assert below["cpu"] == 16 * (prompt_blocks + (answer_blocks if offload_answers else 0))

        turn, prompt_blocks, answer_blocks = chat("Name a planet. " + PROMPT * 2)
        reused = llm.generate(turn, one_token)[0].cached_tokens_by_tier  # the answer reused from the device
        assert reused["device"] >= 16 * (prompt_blocks + answer_blocks)
        assert llm.reset_prefix_cache()
        below = llm.generate(turn, one_token)[0].cached_tokens_by_tier
        assert below["cpu"] >= 16 * (prompt_blocks + answer_blocks)
