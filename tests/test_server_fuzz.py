"""Bad input of any kind is a 4xx in OpenAI's error shape, never a 500 or a traceback: request bodies
drawn at random (every field the routes know, with values of every JSON type, in and out of range)
against the real app over the stand-in engine (tests/serving_fakes.py)."""
from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_fakes import client, fake_app

SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                   "n", "cache_salt", "ignore_eos", "user", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_p", "min_tokens", "stop_token_ids",
                   "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens"]
ROUTE_FIELDS = {
    "/v1/completions": SAMPLING_FIELDS + ["prompt", "logprobs", "best_of", "echo", "suffix", "response_format"],
    "/v1/chat/completions": SAMPLING_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                               "echo", "tools", "response_format"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"],
    "/detokenize": ["model", "tokens"],
}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(["", "x", "fake-model", "\u00e9", "hi!"]))
garbage = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                       max_leaves=8)
token_ids = st.lists(st.integers(-2, 300), max_size=6)
texts = st.text(max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", ""]),
                                 "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2))})
# Values near what clients send for each field, in and out of range; any field may get garbage instead.
PLAUSIBLE = {
    "model": st.sampled_from(["fake-model", "gpt-4", None]),
    "max_tokens": st.integers(-1, 20), "max_completion_tokens": st.integers(-1, 20),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 400),
    "seed": st.integers(-2**64, 2**64), "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "n": st.integers(-1, 4), "cache_salt": texts, "ignore_eos": st.booleans(), "user": texts,
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-0.5, 3), "min_p": st.floats(-0.5, 1.5), "min_tokens": st.integers(-1, 20),
    "logit_bias": st.dictionaries(st.integers(-5, 300).map(str), st.floats(-150, 150), max_size=3),
    "stop_token_ids": token_ids, "logprobs": st.one_of(st.integers(-1, 25), st.booleans()),
    "top_logprobs": st.integers(-1, 25), "prompt_logprobs": st.integers(-1, 25), "echo": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "best_of": st.integers(0, 3),
    "suffix": st.sampled_from(["", None, "end"]), "tools": st.sampled_from([None, []]),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]),
        st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "yaml"]),
                               "json_schema": st.fixed_dictionaries({"name": texts, "schema": garbage})})),
    "prompt": st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=3)),
    "messages": st.lists(message, max_size=3), "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(), "tokens": token_ids,
}
BASE = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [104]}}


@st.composite
def bodies(draw, path: str):
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(ROUTE_FIELDS[path]), unique=True, max_size=6)):
        body[name] = draw(st.one_of(PLAUSIBLE[name], PLAUSIBLE[name], PLAUSIBLE[name], garbage))
    return body


async def _answer(app, path: str, body: dict):
    async with client(app) as http:
        # json.dumps writes NaN and Infinity as Python's json reads them (clients do send them)
        return await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=st.sampled_from(sorted(ROUTE_FIELDS)))
def test_any_body_is_answered_or_refused_with_an_openai_error_never_a_500(data, path):
    body = data.draw(bodies(path))
    response = asyncio.run(_answer(fake_app(), path, body))
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text, (path, body, response.text)
