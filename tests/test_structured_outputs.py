"""Structured outputs: answers held to a JSON schema, or to any JSON object, through the Python API on
the embedded model (engine/structured_outputs.py); the HTTP face's `response_format` is in
test_server.py and test_server_app.py."""
from __future__ import annotations

import json

import pytest

from kvstrata import LLM, SamplingParams, StructuredOutputsParams

VERDICT = {"type": "object",  # "year" first: the answer's fields come in the schema's order, not sorted
           "properties": {"year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                          "answer": {"enum": ["yes", "no"]}},
           "required": ["year", "answer"], "additionalProperties": False}
QUESTION = ("The library opened in 1891 and was rebuilt in 1954. Did the library open before 1900? "
            "Answer in JSON with the year it opened.")


def follows_verdict(text: str) -> bool:
    value = json.loads(text)
    return (list(value) == ["year", "answer"] and value["answer"] in ("yes", "no")
            and isinstance(value["year"], int) and 1000 <= value["year"] <= 2100)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"json": VERDICT, "json_object": True}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "a JSON schema is a JSON object, got list"),
    ({"json_object": "yes"}, "json_object must be true or false"),
])
def test_bad_structured_outputs_are_one_line_errors_naming_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=r"^structured_outputs: ") as exc:
        StructuredOutputsParams(**kwargs)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_schema_given_as_a_dict_or_as_text_is_the_same_schema_its_order_kept():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a == b and a.json == '{"type":"object","properties":{"b":{},"a":{}}}'


@pytest.fixture(scope="module")
def llm(embedded_model_fp32):
    with LLM({"model": {"dtype": "float32", "device": "cpu"}, "cache": {"tiers": {"device": {"size": 64}}}},
             loaded_model=embedded_model_fp32) as llm:
        yield llm


@pytest.mark.slow
def test_a_schema_holds_greedy_and_sampled_answers_which_end_when_their_json_is_complete(llm):
    schema = StructuredOutputsParams(json=VERDICT)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=schema)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=4, structured_outputs=schema)
    outs = llm.chat([{"role": "user", "content": QUESTION}], greedy)
    outs += llm.chat([{"role": "user", "content": QUESTION}], sampled)
    answers = [sequence for out in outs for sequence in out.outputs]
    assert len(answers) == 5 and len({a.text for a in answers[1:]}) > 1  # the seeds sampled different answers
    for out in answers:
        assert out.finish_reason == "stop" and follows_verdict(out.text), out.text
    free, = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=40, temperature=0.0))
    assert not free.text.startswith('{"answer": ')  # the schema, not the model, made the answers JSON


@pytest.mark.slow
def test_any_json_object_is_held_and_a_batch_masks_only_its_structured_rows(llm):
    prompt = "Describe a cat as a JSON object with its name and age."
    alone, = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    batch = llm.generate([prompt, prompt], [SamplingParams(max_tokens=12, temperature=0.0),
                                            SamplingParams(max_tokens=200, temperature=0.0,
                                                           structured_outputs=StructuredOutputsParams(json_object=True))])
    assert batch[0].token_ids == alone.token_ids  # the unstructured row of the batch is untouched
    structured = batch[1]
    assert structured.text.lstrip().startswith("{")
    if structured.finish_reason == "stop":  # complete: a JSON object
        assert isinstance(json.loads(structured.text), dict)


@pytest.mark.slow
def test_a_schema_the_grammar_cannot_follow_is_refused_before_any_work(llm):
    queries = llm.stats()["prefix_cache"]["query_tokens"]
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "frobnicate"}}})
    with pytest.raises(ValueError, match=r"^structured_outputs: the JSON schema cannot be followed: ") as exc:
        llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=bad))
    assert "\n" not in str(exc.value) and str(exc.value).endswith('Unsupported type "frobnicate"')
    assert llm.stats()["prefix_cache"]["query_tokens"] == queries
    assert not llm.engine.has_unfinished_requests()
