"""The HTTP face without a model: the real app (middleware, schemas, routes, error shapes) over a
stand-in engine, driven in-process through httpx (tests/serving_fakes.py)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from kvstrata.serving.middleware import DrainState
from kvstrata.serving.server import stopped_message
from kvstrata.engine.structured_outputs import StructuredOutputsParams
from serving_fakes import BLOCK_NAMING, MODEL, ByteTokenizer, FakeAsyncEngine, client, fake_app

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}]}


def run(coroutine):
    return asyncio.run(coroutine)


async def post(app, path: str, body, headers: dict | None = None):
    async with client(app) as http:
        if isinstance(body, bytes):
            return await http.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})
        return await http.post(path, json=body, headers=headers)


async def get(app, path: str, headers: dict | None = None):
    async with client(app) as http:
        return await http.get(path, headers=headers)


def assert_openai_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def sse_chunks(response) -> list[dict]:
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


# ---------------------------------------------------------------------------------------------
# API key


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
                         ids=["no header", "wrong key", "no scheme", "basic scheme", "longer key"])
def test_api_routes_refuse_a_missing_or_wrong_key_with_openai_401(headers):
    app = fake_app(api_key=KEY)
    for response in (run(post(app, "/v1/completions", {"prompt": "x"}, headers)), run(get(app, "/v1/models", headers)),
                     run(get(app, "/v1/no-such-route", headers))):
        error = assert_openai_error(response, 401, code="invalid_api_key")
        assert KEY not in error["message"] and "wrong" not in error["message"].split(":")[-1]
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_is_let_in_whatever_the_case_of_its_scheme():
    app = fake_app(api_key=KEY)
    assert run(post(app, "/v1/completions", {"prompt": "x"}, AUTH)).status_code == 200
    assert run(get(app, "/v1/models", {"Authorization": f"bearer {KEY}"})).status_code == 200


def test_health_and_metrics_need_no_key():
    app = fake_app(api_key=KEY)
    assert run(get(app, "/health")).json() == {"status": "ok", "block_naming": BLOCK_NAMING.to_json()}
    assert run(get(app, "/metrics")).status_code == 200


def test_without_a_configured_key_no_header_is_needed():
    assert run(post(fake_app(), "/v1/completions", {"prompt": "x"})).status_code == 200


# ---------------------------------------------------------------------------------------------
# Routes and errors


def test_unknown_route_and_wrong_method_answer_in_openai_shape():
    app = fake_app()
    assert_openai_error(run(get(app, "/v1/nothing-here")), 404, code="not_found")
    error = assert_openai_error(run(get(app, "/v1/completions")), 405, code="method_not_allowed")
    assert "POST" in error["message"]
    assert_openai_error(run(post(app, "/health", {})), 405, code="method_not_allowed")


def test_a_wrong_method_names_every_method_the_path_answers():
    # /v1/cache/documents has a GET route and a POST route: a 405 must name both, not the first one found
    async def put(app):
        async with client(app) as http:
            return await http.put("/v1/cache/documents", json={})

    response = run(put(fake_app()))
    error = assert_openai_error(response, 405, code="method_not_allowed")
    assert response.headers["allow"] == "GET, POST"
    assert error["message"].endswith("(allowed: GET, POST)")


def test_body_over_the_limit_is_refused_with_413_by_its_content_length():
    error = assert_openai_error(run(post(fake_app(max_request_body=1024), "/v1/completions",
                                         {"prompt": "x" * 2000})), 413, code="request_too_large")
    assert "1KiB" in error["message"] and "server.max_request_body" in error["message"]


def test_streamed_body_without_a_length_is_counted_and_refused_with_413():
    async def chunked(size: int):
        async def body():
            for _ in range(size // 100):
                yield b" " * 100  # JSON allows leading whitespace: only the size matters here
            yield json.dumps({"prompt": "x", "max_tokens": 1}).encode()

        async with client(fake_app(max_request_body=1024)) as http:
            return await http.post("/v1/completions", content=body(), headers={"content-type": "application/json"})

    assert_openai_error(run(chunked(5000)), 413, code="request_too_large")
    assert run(chunked(500)).status_code == 200


BAD_FIELDS = [
    ("/v1/completions", "best_of", 2), ("/v1/completions", "spaces_between_special_tokens", False),
    ("/v1/completions", "echo", 3), ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "n", 0), ("/v1/completions", "n", 129), ("/v1/chat/completions", "n", 1.5),
    ("/v1/completions", "presence_penalty", 2.5),
    ("/v1/completions", "frequency_penalty", -3), ("/v1/completions", "repetition_penalty", 0),
    ("/v1/completions", "logit_bias", {"42": -101}), ("/v1/completions", "logit_bias", {"-1": 5}),
    ("/v1/completions", "min_p", 1.5),
    ("/v1/completions", "min_tokens", 17), ("/v1/completions", "stop_token_ids", [-2]),
    ("/v1/completions", "stop_token_ids", "2"), ("/v1/completions", "no_such_field", 1),
    ("/v1/completions", "logprobs", 21), ("/v1/completions", "seed", 2**63), ("/v1/completions", "seed", -2**63 - 1),
    ("/v1/completions", "temperature", "hot"), ("/v1/completions", "max_tokens", 0),
    ("/v1/completions", "stop", 3), ("/v1/completions", "prompt", 3),
    ("/v1/chat/completions", "echo", True), ("/v1/chat/completions", "tools", [{"type": "function"}]),
    ("/v1/chat/completions", "frequency_penalty", 2.01), ("/v1/chat/completions", "top_logprobs", 30),
    ("/v1/chat/completions", "max_completion_tokens", -1),
    # JSON's booleans are no numbers (pydantic alone would take true as 1)
    ("/v1/completions", "max_tokens", True), ("/v1/completions", "logprobs", True),
    ("/v1/chat/completions", "temperature", False), ("/v1/completions", "seed", True),
]


@pytest.mark.parametrize("path,field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for _, f, v in BAD_FIELDS])
def test_a_bad_or_unsupported_field_is_400_naming_it(path, field, value):
    body = {"prompt": "x"} if path == "/v1/completions" else dict(CHAT)
    body[field] = value
    if field == "top_logprobs":
        body["logprobs"] = True
    engine = FakeAsyncEngine()
    error = assert_openai_error(run(post(fake_app(engine), path, body)), 400, param=field)
    assert error["message"].startswith(field)
    assert engine.received == []  # nothing reached the engine


@pytest.mark.parametrize("fields, param, fragment", [
    ({"max_tokens": -1, "max_completion_tokens": 3}, "max_completion_tokens", "differs from max_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens", "differs from max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only with stream: true"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "only with stream: true"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages.0.role", "expected a role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
     "messages.0.content", "'cache_control'"),
], ids=["invalid max_tokens beside max_completion_tokens", "two limits", "stream_options alone",
        "stream_options with stream false", "empty role", "a text part's extra key"])
def test_fields_that_contradict_or_ask_nothing_are_400_naming_the_field(fields, param, fragment):
    engine = FakeAsyncEngine()
    error = assert_openai_error(run(post(fake_app(engine), "/v1/chat/completions", {**CHAT, **fields})), 400, param)
    assert fragment in error["message"] and engine.received == []
    assert run(post(fake_app(), "/v1/chat/completions", {**CHAT, "max_tokens": 3,
                                                         "max_completion_tokens": 3})).status_code == 200


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_sent_as_another_content_type_is_400_saying_so(content_type):
    async def send(app):
        async with client(app) as http:
            return await http.post("/v1/completions", content=b'{"prompt": "x"}',
                                   headers={"content-type": content_type} if content_type else {})

    error = assert_openai_error(run(send(fake_app())), 400)
    assert "Content-Type: application/json" in error["message"]


def test_token_ids_to_detokenize_are_numbers_not_booleans():
    error = assert_openai_error(run(post(fake_app(), "/detokenize", {"tokens": [1, True]})), 400, param="tokens.1")
    assert "got true" in error["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\udfff"]}', "stop"),
    ("/v1/completions", b'{"prompt": "a", "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages.0.role"),
], ids=["prompt", "stop", "cache_salt", "message", "message part", "role"])
def test_a_lone_surrogate_is_400_naming_the_field(path, body, param):
    error = assert_openai_error(run(post(fake_app(), path, body)), 400, param=param)
    assert "not valid Unicode" in error["message"]


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("response_format, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
     StructuredOutputsParams(json=SCHEMA)),
], ids=["text", "json_object", "json_schema"])
def test_response_format_reaches_the_engine_as_its_structured_outputs(path, response_format, expected):
    body = {"prompt": "x"} if path == "/v1/completions" else dict(CHAT)
    engine = FakeAsyncEngine()
    assert run(post(fake_app(engine), path, {**body, "response_format": response_format})).status_code == 200
    assert engine.received[0][1].structured_outputs == expected


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_object", "json_schema": {"schema": SCHEMA}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "no schema"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ("json", "response_format"),
])
def test_a_bad_response_format_is_400_naming_where(response_format, param):
    engine = FakeAsyncEngine()
    assert_openai_error(run(post(fake_app(engine), "/v1/chat/completions", {**CHAT, "response_format": response_format})),
                        400, param=param)
    assert engine.received == []


def test_fields_clients_send_at_their_no_op_values_are_accepted():
    # As the official client, guidellm and others send them: null, or the value that asks for nothing.
    completion = {"model": MODEL, "prompt": ["hello"], "max_tokens": 3, "best_of": 1, "echo": False, "suffix": None,
                  "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "logit_bias": None, "logprobs": None, "user": "someone", "stop": None, "seed": None,
                  "temperature": None, "top_p": None, "ignore_eos": True, "min_p": 0.0, "min_tokens": 0,
                  "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True}
    assert run(post(fake_app(), "/v1/completions", completion)).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "max_completion_tokens": 3, "stop": None, "ignore_eos": True, "logprobs": False, "top_logprobs": None,
            "tools": None, "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
            "store": False, "metadata": None, "service_tier": "auto", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert run(post(fake_app(), "/v1/chat/completions", chat)).status_code == 200


def test_penalties_min_p_min_tokens_stop_token_ids_and_logit_bias_reach_the_engine():
    fields = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1,
              "min_tokens": 2, "stop_token_ids": [2, 5], "logit_bias": {"42": -100, "7": 2.5},
              "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": True}
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 4}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 4})):
        engine = FakeAsyncEngine()
        assert run(post(fake_app(engine), path, {**body, **fields})).status_code == 200
        (_, params), = engine.received
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
        assert (params.min_p, params.min_tokens, params.stop_token_ids) == (0.1, 2, [2, 5])
        assert params.logit_bias == {42: -100.0, 7: 2.5}  # JSON's string keys are token ids
        assert params.include_stop_str_in_output and not params.skip_special_tokens
    not_an_id = run(post(fake_app(), "/v1/completions", {"prompt": "x", "logit_bias": {"the": 5}}))
    assert "integer" in assert_openai_error(not_an_id, 400, param="logit_bias.the")["message"]


def test_the_stop_token_that_ended_an_answer_is_its_stop_reason_whole_or_streamed():
    stop = {"stop_token_ids": [ord("i")]}  # the reply is "hi!": it ends at "i", which is not shown
    whole = run(post(fake_app(), "/v1/completions", {"prompt": "x", **stop})).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == ("h", "stop", ord("i"))
    chat = run(post(fake_app(), "/v1/chat/completions", {**CHAT, **stop})).json()["choices"][0]
    assert (chat["message"]["content"], chat["stop_reason"]) == ("h", ord("i"))
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)):
        chunks = sse_chunks(run(post(fake_app(), path, {**body, **stop, "stream": True})))
        last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", ord("i"))
    plain = run(post(fake_app(), "/v1/completions", {"prompt": "x"})).json()["choices"][0]
    assert plain["stop_reason"] is None and plain["text"] == "hi!"


def test_an_engine_refusal_is_400_and_a_stopped_engine_503():
    from kvstrata.engine.async_engine import EngineStoppedError

    assert_openai_error(run(post(fake_app(), "/v1/completions", {"prompt": []})), 400, param="prompt")

    class StoppedEngine(FakeAsyncEngine):
        def generate(self, *args, **kwargs):
            raise EngineStoppedError("the engine is shutting down and takes no new requests")

    assert run(post(fake_app(StoppedEngine()), "/v1/completions", {"prompt": "x"})).status_code == 503


def test_a_draining_server_refuses_new_api_requests_with_503_and_reports_unhealthy():
    app = fake_app(drain=DrainState(draining=True))
    error = assert_openai_error(run(post(app, "/v1/completions", {"prompt": "x"})), 503)
    assert error["type"] == "service_unavailable"
    assert run(get(app, "/health")).status_code == 503


def test_requests_in_flight_are_counted_until_their_last_event():
    drain = DrainState()
    seen = []

    class WatchedEngine(FakeAsyncEngine):
        async def _outputs(self, *args):
            async for output in super()._outputs(*args):
                seen.append(drain.in_flight)
                yield output

    app = fake_app(WatchedEngine(), drain=drain)
    run(post(app, "/v1/completions", {"prompt": "x", "stream": True}))
    assert seen and set(seen) == {1}
    assert drain.in_flight == 0


def test_tokenizing_happens_off_the_event_loop():
    """A tokenizer that blocks until /health has answered: on the event loop it would never finish."""
    health_answered = threading.Event()

    class WaitingTokenizer(ByteTokenizer):
        def __call__(self, text, add_special_tokens=True):
            assert health_answered.wait(30), "the event loop was blocked: /health never answered"
            return super().__call__(text, add_special_tokens)

    from kvstrata.serving.app import build_app
    from kvstrata.serving.metrics import ServingMetrics
    from kvstrata.serving.tokenizer_pool import TokenizerPool

    app = build_app(FakeAsyncEngine(), MODEL, metrics=ServingMetrics(lambda: None),
                    tokenizers=TokenizerPool(WaitingTokenizer(), 2), max_request_body=1 << 20)

    async def both():
        async with client(app) as http:
            completion = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x"}))
            await asyncio.sleep(0.05)
            health = await asyncio.wait_for(http.get("/health"), 30)
            health_answered.set()
            return health, await completion

    health, completion = run(both())
    assert health.status_code == 200 and completion.status_code == 200


# ---------------------------------------------------------------------------------------------
# Logprobs and usage in OpenAI's shapes


def test_completion_logprobs_are_the_legacy_parallel_lists():
    response = run(post(fake_app(), "/v1/completions", {"prompt": "x", "logprobs": 1}))
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["h", "i", "!"], "token_logprobs": [-0.5, -0.5, -0.5],
                        "top_logprobs": [{"h": -0.5}, {"i": -0.5}, {"!": -0.5}], "text_offset": [0, 1, 2]}
    assert run(post(fake_app(), "/v1/completions", {"prompt": "x"})).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_carry_token_bytes_and_top_alternatives():
    engine = FakeAsyncEngine()
    response = run(post(fake_app(engine), "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}))
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["h", "i", "!"]
    assert content[0] == {"token": "h", "logprob": -0.5, "bytes": [104],
                          "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]},
                                           {"token": "i", "logprob": -1.5, "bytes": [105]}]}
    assert engine.received[-1][1].logprobs == 2
    plain = run(post(fake_app(engine), "/v1/chat/completions", {**CHAT, "logprobs": True}))
    assert plain.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert engine.received[-1][1].logprobs == 0


def test_streamed_logprobs_go_with_the_chunk_of_their_tokens():
    response = run(post(fake_app(), "/v1/chat/completions", {**CHAT, "logprobs": True, "stream": True}))
    chunks = sse_chunks(response)
    with_tokens = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [(c["delta"]["content"], [e["token"] for e in c["logprobs"]["content"]]) for c in with_tokens] == [
        ("h", ["h"]), ("i", ["i"]), ("!", ["!"])]
    completion = sse_chunks(run(post(fake_app(), "/v1/completions", {"prompt": "x", "logprobs": 0, "stream": True})))
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in completion] == [[0], [1], [2]]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    body = {"prompt": "abcd", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(run(post(fake_app(), "/v1/completions", body)))
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    plain = sse_chunks(run(post(fake_app(), "/v1/completions", {**body, "stream_options": {"include_usage": True}})))
    assert ["usage" in c for c in plain] == [False, False, False, True]


def test_echo_puts_the_prompt_before_the_answer_with_its_tokens_logprobs_first_unscored():
    plain = run(post(fake_app(), "/v1/completions", {"prompt": "ab", "echo": True})).json()["choices"][0]
    assert plain["text"] == "abhi!" and plain["logprobs"] is None
    by_ids = run(post(fake_app(), "/v1/completions", {"prompt": [ord("a"), ord("b")], "echo": True})).json()
    assert by_ids["choices"][0]["text"] == "abhi!"
    engine = FakeAsyncEngine()
    scored = run(post(fake_app(engine), "/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1})).json()
    assert engine.received[0][1].prompt_logprobs == 1  # the prompt's logprobs were asked of the engine
    logprobs = scored["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "h", "i", "!"] and logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"][:2] == [None, {"b": -1.0}]
    assert scored["usage"]["prompt_tokens"] == 2 and scored["usage"]["completion_tokens"] == 3


def test_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_alternatives_by_token_id():
    engine = FakeAsyncEngine()
    body = {"prompt": ["abc", "d"], "n": 2, "prompt_logprobs": 1, "max_tokens": 2}
    response = run(post(fake_app(engine), "/v1/completions", body)).json()
    assert all(params.prompt_logprobs == 1 for _, params in engine.received)
    choices = response["choices"]
    # vLLM's shape: none for the first token, then the token and its alternatives by id (itself listed once)
    assert choices[0]["prompt_logprobs"] == [None, {"98": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}},
                                             {"99": {"logprob": -1.0, "rank": 1, "decoded_token": "c"}}]
    assert choices[1]["prompt_logprobs"] == choices[0]["prompt_logprobs"]  # every choice of the prompt
    assert choices[2]["prompt_logprobs"] == choices[3]["prompt_logprobs"] == [None]  # one token: nothing scored
    assert all(c["logprobs"] is None and c["text"] == "hi" for c in choices)  # only what was asked
    two = run(post(fake_app(), "/v1/completions", {**body, "prompt": "ab", "n": 1, "prompt_logprobs": 2})).json()
    assert two["choices"][0]["prompt_logprobs"][1] == {"98": {"logprob": -1.0, "rank": 1, "decoded_token": "b"},
                                                       "99": {"logprob": -2.0, "rank": 2, "decoded_token": "c"}}
    plain = run(post(fake_app(), "/v1/completions", {"prompt": "ab"})).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_and_an_echo_with_logprobs_each_get_the_alternatives_they_asked_for():
    engine = FakeAsyncEngine()
    body = {"prompt": "ab", "echo": True, "logprobs": 0, "prompt_logprobs": 2, "max_tokens": 1}
    choice = run(post(fake_app(engine), "/v1/completions", body)).json()["choices"][0]
    assert engine.received[0][1].prompt_logprobs == 2  # the engine computes the most either asks for
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -1.0}, {"h": -0.5}]
    assert len(choice["prompt_logprobs"][1]) == 2


def test_a_chat_reports_its_rendered_prompts_logprobs_once_for_all_its_choices():
    engine = FakeAsyncEngine()
    body = {"messages": [{"role": "user", "content": "hey"}], "n": 2, "prompt_logprobs": 0, "max_tokens": 1}
    response = run(post(fake_app(engine), "/v1/chat/completions", body)).json()
    rendered = engine.received[0][0]
    assert len(response["prompt_logprobs"]) == len(rendered) and response["prompt_logprobs"][0] is None
    assert [list(p) for p in response["prompt_logprobs"][1:]] == [[str(t)] for t in rendered[1:]]
    assert all("prompt_logprobs" not in c for c in response["choices"])
    plain = run(post(fake_app(), "/v1/chat/completions", {**body, "prompt_logprobs": None})).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "ab"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 0, "stream": True}, {"prompt_logprobs": -1},
                                   {"prompt_logprobs": 21}, {"prompt_logprobs": "all"}])
def test_prompt_logprobs_out_of_range_or_on_a_stream_are_refused(path, body, extra):
    engine = FakeAsyncEngine()
    assert_openai_error(run(post(fake_app(engine), path, {**body, **extra})), 400, param="prompt_logprobs")
    assert engine.received == []


def test_a_streamed_echo_repeats_each_prompt_in_the_first_chunk_of_its_choices():
    body = {"prompt": ["ab", "c"], "n": 2, "echo": True, "logprobs": 0, "stream": True}
    chunks = sse_chunks(run(post(fake_app(), "/v1/completions", body)))
    texts, tokens = {}, {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        tokens[choice["index"]] = tokens.get(choice["index"], []) + choice["logprobs"]["tokens"]
    assert texts == {0: "abhi!", 1: "abhi!", 2: "chi!", 3: "chi!"}
    assert tokens[0] == ["a", "b", "h", "i", "!"] and tokens[2] == ["c", "h", "i", "!"]


# ---------------------------------------------------------------------------------------------
# vLLM's /tokenize and /detokenize


def test_tokenize_gives_the_ids_a_completion_or_a_chat_would_compute_and_the_context_length():
    app = fake_app(FakeAsyncEngine(max_model_len=300))
    prompt = run(post(app, "/tokenize", {"prompt": "héllo"})).json()
    assert prompt == {"count": 6, "max_model_len": 300, "tokens": list("héllo".encode())}
    chat = run(post(app, "/tokenize", {"model": MODEL, **CHAT})).json()
    assert chat["tokens"] == list(b"user: Say hi.\nassistant: ") and chat["count"] == len(chat["tokens"])
    assert run(post(app, "/detokenize", {"tokens": prompt["tokens"]})).json() == {"prompt": "héllo"}


def test_a_chat_is_rendered_as_its_rendering_fields_ask_and_tokenize_renders_it_the_same():
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi, I am"}]
    cases = [({}, b"user: Say hi.\nassistant: Hi, I am\nassistant: "),
             ({"add_generation_prompt": False}, b"user: Say hi.\nassistant: Hi, I am\n"),
             ({"add_generation_prompt": False, "continue_final_message": True}, b"user: Say hi.\nassistant: Hi, I am"),
             ({"chat_template_kwargs": {"system": "Be brief.\n"}},
              b"Be brief.\nuser: Say hi.\nassistant: Hi, I am\nassistant: ")]
    for fields, rendered in cases:
        engine = FakeAsyncEngine()
        app = fake_app(engine)
        assert run(post(app, "/v1/chat/completions", {"messages": messages, **fields})).status_code == 200
        assert engine.received[0][0] == list(rendered), fields
        assert run(post(app, "/tokenize", {"messages": messages, **fields})).json()["tokens"] == list(rendered)


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # the reply's prompt would close it
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),  # the call's own parameter
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["system"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "maybe"}, "add_generation_prompt"),
])
def test_rendering_fields_that_cannot_apply_are_refused_naming_the_field(fields, param):
    for path in ("/v1/chat/completions", "/tokenize"):
        engine = FakeAsyncEngine()
        assert_openai_error(run(post(fake_app(engine), path, {**CHAT, **fields})), 400, param=param)
        assert engine.received == []


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "messages"), ("/tokenize", {"prompt": "x", **CHAT}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/detokenize", {"tokens": [104, 256]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
], ids=["nothing", "both", "no special tokens", "unknown model", "id past the vocabulary", "negative id",
        "not ids"])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(path, body, param):
    response = run(post(fake_app(), path, body))
    assert_openai_error(response, 404 if param == "model" else 400, param=param)


def test_tokenize_and_detokenize_need_the_key_like_the_v1_routes():
    app = fake_app(api_key=KEY)
    assert_openai_error(run(post(app, "/tokenize", {"prompt": "x"})), 401, code="invalid_api_key")
    assert_openai_error(run(post(app, "/detokenize", {"tokens": [1]})), 401, code="invalid_api_key")
    assert run(post(app, "/tokenize", {"prompt": "x"}, AUTH)).status_code == 200


# ---------------------------------------------------------------------------------------------
# Several choices: n, and a batch of prompts


def _reply_naming_prompt_and_seed(token_ids: list[int], params) -> str:
    return f"{bytes(token_ids).decode()}/{params.seed}"


def test_n_choices_are_requests_of_their_own_with_consecutive_seeds_and_the_prompt_counted_once():
    engine = FakeAsyncEngine(reply=_reply_naming_prompt_and_seed)
    body = {"prompt": "abc", "n": 3, "seed": 7, "max_tokens": 8}
    response = run(post(fake_app(engine), "/v1/completions", body)).json()
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, "abc/7"), (1, "abc/8"), (2, "abc/9")]
    assert len(set(engine.request_ids)) == 3
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 15, "total_tokens": 18,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    # each choice carries its own receipt; the response carries its first token's
    assert all(c["kvstrata"]["ttft_ms"] == 1.0 for c in response["choices"])
    assert response["kvstrata"]["ttft_ms"] == 1.0
    unseeded = FakeAsyncEngine()
    run(post(fake_app(unseeded), "/v1/chat/completions", {**CHAT, "n": 2}))
    assert [params.seed for _, params in unseeded.received] == [None, None]


def test_a_seed_at_the_top_of_its_range_wraps_for_the_next_choices():
    engine = FakeAsyncEngine()
    assert run(post(fake_app(engine), "/v1/completions", {"prompt": "x", "n": 2, "seed": 2**63 - 1})).status_code == 200
    assert sorted(params.seed for _, params in engine.received) == [-2**63, 2**63 - 1]


def test_one_choice_keeps_its_receipt_on_the_response_only():
    choice = run(post(fake_app(), "/v1/completions", {"prompt": "x"})).json()["choices"][0]
    assert "kvstrata" not in choice


def test_a_batch_of_prompts_answers_n_choices_for_each_in_order():
    engine = FakeAsyncEngine(reply=_reply_naming_prompt_and_seed)
    body = {"prompt": ["ab", [ord("x"), ord("y"), ord("z")]], "n": 2, "seed": 0, "max_tokens": 8}
    response = run(post(fake_app(engine), "/v1/completions", body)).json()
    assert [c["text"] for c in response["choices"]] == ["ab/0", "ab/1", "xyz/0", "xyz/1"]
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert response["usage"]["prompt_tokens"] == 5 and response["usage"]["completion_tokens"] == 18


def test_cached_tokens_of_a_prompt_are_those_every_one_of_its_choices_found():
    class OneChoiceComputes(FakeAsyncEngine):
        """The first choice computes the prompt; the others find its blocks on the device."""

        async def _outputs(self, request_id, token_ids, params):
            async for output in super()._outputs(request_id, token_ids, params):
                if not request_id.endswith("-0"):
                    output.cached_tokens, output.cached_tokens_by_tier["device"] = 16, 16
                    output.ttft_s = 0.0005
                yield output

    response = run(post(fake_app(OneChoiceComputes()), "/v1/completions", {"prompt": "x" * 20, "n": 3})).json()
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [c["kvstrata"]["cached_tokens_by_tier"]["device"] for c in response["choices"]] == [0, 16, 16]
    assert response["kvstrata"]["ttft_ms"] == 0.5  # the first first token's receipt


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)])
def test_streamed_choices_interleave_each_with_its_index_finish_and_receipt(path, body):
    body = {**body, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(run(post(fake_app(), path, body)))
    *choice_chunks, usage_chunk = chunks
    texts, finished = {0: "", 1: ""}, {}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"] if "text" in choice else choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finished[choice["index"]] = chunk["kvstrata"]["ttft_ms"]
    assert texts == {0: "hi!", 1: "hi!"} and finished == {0: 1.0, 1: 1.0}
    if path.endswith("chat/completions"):  # a role chunk for each choice comes first
        assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [
            (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["kvstrata"]["ttft_ms"] == 1.0


def test_too_many_choices_or_a_bad_prompt_in_a_batch_is_400_with_nothing_queued():
    engine = FakeAsyncEngine()
    error = assert_openai_error(run(post(fake_app(engine), "/v1/completions", {"prompt": ["x"] * 17, "n": 128})),
                                400, param="n")
    assert "2176 choices" in error["message"]
    error = assert_openai_error(run(post(fake_app(engine), "/v1/completions", {"prompt": ["x", 3]})), 400, "prompt")
    assert "item 1 of the batch" in error["message"]
    assert_openai_error(run(post(fake_app(engine), "/v1/completions", {"prompt": ["x", ""]})), 400, param="prompt")
    assert engine.received == []


def test_a_failing_choice_ends_the_stream_with_an_error_and_aborts_the_others():
    unfinished = []

    class FailingSecondChoice(FakeAsyncEngine):
        async def _outputs(self, request_id, token_ids, params):
            finished = False
            try:
                async for output in super()._outputs(request_id, token_ids, params):
                    if request_id.endswith("-1"):
                        raise RuntimeError("the engine failed")
                    finished = output.finished
                    yield output
                    await asyncio.sleep(0.05)
            finally:
                if not finished:
                    unfinished.append(request_id[-2:])

    response = run(post(fake_app(FailingSecondChoice()), "/v1/completions", {"prompt": "x", "n": 3, "stream": True}))
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "the engine failed" in events[-2]
    assert sorted(unfinished) == ["-0", "-1", "-2"]  # the others were closed (aborted) mid-answer


def test_a_single_choice_that_fails_mid_answer_ends_its_stream_with_an_error_after_what_it_sent():
    class FailingAfterItsFirstOutput(FakeAsyncEngine):
        async def _outputs(self, request_id, token_ids, params):
            async for output in super()._outputs(request_id, token_ids, params):
                yield output
                raise RuntimeError("the engine failed")

    response = run(post(fake_app(FailingAfterItsFirstOutput()), "/v1/completions", {"prompt": "x", "stream": True}))
    events = [e for e in response.text.split("\n\n") if e]
    assert len(events) == 3 and '"text":' in events[0]
    assert "the engine failed" in events[1] and events[2] == "data: [DONE]"


# ---------------------------------------------------------------------------------------------
# Shutdown report


def _final_stats(write_errors: int) -> dict:
    return {"tiers": {"device": {"extra": {}}, "disk": {"extra": {"write_errors": write_errors}}}}


def test_stop_message_says_the_cache_was_written_down_only_if_every_write_succeeded(tmp_path):
    from kvstrata.engine.config import load_config

    config = load_config(None, {"cache.tiers.disk.path": str(tmp_path / "kv"), "cache.tiers.disk.size": "64MiB"})
    where = config.cache.tiers.disk.path
    assert stopped_message(config, _final_stats(0)) == f"kvstrata: stopped; cache written down to {where}"
    failed = stopped_message(config, _final_stats(3))
    assert "3 writes to the disk tier" in failed and "failed" in failed and "written down to" not in failed
    assert "failed" in stopped_message(config, None)
    assert stopped_message(load_config(None), None) == "kvstrata: stopped"


def test_the_banner_names_the_kv_cache_dtype_where_it_differs_from_the_models():
    from kvstrata import load_config
    from kvstrata.serving.server import dtype_phrase

    stats = {"dtype": "float32", "kv_cache_dtype": "float32"}
    assert dtype_phrase(load_config({}), stats) == "float32 (auto)"
    narrow = load_config({"model": {"dtype": "float32"}, "cache": {"kv_cache_dtype": "int8"}})
    assert dtype_phrase(narrow, {**stats, "kv_cache_dtype": "int8"}) == "float32, K/V in int8"


def test_whole_answers_are_the_json_fastapi_would_have_written():
    """The server writes whole answers with pydantic's serializer (off the event loop); clients get
    the same JSON as FastAPI's own encoding of the same answer: nulls, fields left out, non-ASCII
    text, log-probabilities and the chat's top-level prompt_logprobs alike."""
    from fastapi.encoders import jsonable_encoder

    from kvstrata.serving.responses import _json_bytes
    from kvstrata.serving.schemas import (AssistantMessage, ChatChoice, ChatCompletionResponse, CompletionChoice,
                                          CompletionResponse, KvstrataInfo, PromptTokensDetails, Usage)

    entries = [None, {"98": {"logprob": -1.5, "rank": 2, "decoded_token": "é"}}]
    usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    receipt = KvstrataInfo(cached_tokens_by_tier={"device": 0}, ttft_ms=1.25, queue_ms=None)
    answers = [
        CompletionResponse(id="a", created=1, model=MODEL, choices=[
            CompletionChoice(index=0, text="naïve – 日本", finish_reason="stop", stop_reason=13),
            CompletionChoice(index=1, text="", finish_reason="length", prompt_logprobs=entries)]),
        ChatCompletionResponse(id="b", created=1, model=MODEL, prompt_logprobs=entries, usage=usage,
                               kvstrata=receipt, choices=[
            ChatChoice(index=0, message=AssistantMessage(content="ok"), finish_reason="stop")]),
    ]
    for answer in answers:
        assert json.loads(_json_bytes(None, answer)) == json.loads(json.dumps(jsonable_encoder(answer)))
    assert "naïve – 日本".encode() in _json_bytes(None, answers[0])  # UTF-8, as FastAPI writes it
    choices = json.loads(_json_bytes(None, answers[0]))["choices"]
    assert "prompt_logprobs" not in choices[0] and choices[1]["prompt_logprobs"] == entries


def test_a_reset_that_could_not_clear_a_tier_is_a_503_naming_it_and_the_tiers_that_were():
    from kvstrata.engine.llm_engine import CacheReset

    engine, asked = FakeAsyncEngine(), []

    class Engine:
        @staticmethod
        def reset_prefix_cache(reset_external: bool) -> CacheReset:
            asked.append(reset_external)
            return CacheReset(tiers=["device", "cpu", "disk"], not_cleared=["remote"])

    async def call(fn):
        return fn(Engine())

    engine.call = call
    response = run(post(fake_app(engine), "/reset_prefix_cache?reset_external=1", None))
    error = assert_openai_error(response, 503, code="tier_unavailable")
    assert asked == [True]
    assert error["message"].startswith("the remote tier could not be cleared") and "device, cpu, disk" in error["message"]
