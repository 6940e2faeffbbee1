"""The OpenAI-compatible server, end to end: one `kvstrata serve` process (the embedded model, fp32,
small tiers) for the whole file, driven by the official `openai` client and by plain HTTP.

The last test stops the server with SIGTERM; it must stay last in this file."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from server_process import REPO, ServerProcess, metric_value, serve_command, server_env

pytestmark = pytest.mark.timeout(600)

DOCUMENT = (
    "The Harbor Street library opened in 1921 and was designed by the architect Mara Velde. "
    "It holds 42,000 books and a collection of old maps of the river delta. In 1987 a fire destroyed "
    "the east wing, which was rebuilt two years later with a glass roof. The head librarian, Tomas Reyl, "
    "started a Saturday reading club for children in 2004; about thirty children come every week. "
    "The reading room on the second floor is open from eight in the morning until nine at night, "
    "and the map room can be visited on Tuesdays and Thursdays with a guide. "
) * 2


def document_chat(question: str) -> list[dict]:
    return [{"role": "user", "content": f"Document:\n{DOCUMENT}\nQuestion: {question}"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("kvstore"))
    yield process
    process.kill()  # normally already stopped by the SIGTERM test


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as http_client:
        yield http_client


def test_serve_on_a_port_in_use_is_one_line_error_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(serve_command(f"cache.tiers.disk.path={tmp_path / 'kv'}", port=port),
                                capture_output=True, text=True, env=server_env(), cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvstrata: error: server.port: 127.0.0.1:{port} is already in use (choose another with --port)"]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_startup_banner_names_address_model_and_tier_sizes(server):
    banner = server.output
    assert f"listening on {server.base_url}" in banner
    assert "serving smollm2-135m-instruct (float32 on cpu, " in banner
    for tier in ("device tier:", "cpu tier:", "disk tier:"):
        assert tier in banner
    assert "128 blocks" in banner  # the device tier as configured


@pytest.mark.slow
def test_health_and_models_list_the_served_model(http, client):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]


@pytest.mark.slow
def test_completion_with_openai_client_reports_usage_and_cache_tiers(client):
    completion = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                           max_tokens=6, temperature=0)
    choice = completion.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    kv = completion.model_extra["kvstrata"]
    assert set(kv["cached_tokens_by_tier"]) == {"device", "cpu", "disk"}
    assert sum(kv["cached_tokens_by_tier"].values()) == usage.prompt_tokens_details.cached_tokens
    assert kv["ttft_ms"] > 0


@pytest.mark.slow
def test_completion_prompt_may_be_token_ids_or_a_batch_of_one(client, http):
    token_ids = [504, 3575, 282, 4649, 314]
    single = client.completions.create(model="smollm2-135m-instruct", prompt=token_ids, max_tokens=4, temperature=0)
    assert single.usage.prompt_tokens == len(token_ids)
    assert single.choices[0].text
    batch_of_one = client.completions.create(model="smollm2-135m-instruct", prompt=[token_ids], max_tokens=4,
                                             temperature=0)
    assert batch_of_one.choices[0].text == single.choices[0].text
    batch_of_two = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert batch_of_two.status_code == 400
    assert batch_of_two.json()["error"]["param"] == "prompt"


@pytest.mark.slow
def test_chat_with_openai_client(client):
    reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 8
    assert "ttft_ms" in reply.model_extra["kvstrata"]


@pytest.mark.slow
def test_chat_streaming_sends_role_then_deltas_then_finish_reason_and_usage(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # streamed token by token, not in one piece
    assert "".join(c.choices[0].delta.content for c in content_chunks) == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.slow
def test_completion_stream_is_server_sent_events_ending_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "One, two, three,", "max_tokens": 4,
                                                      "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "kvstrata" in chunks[-1]


@pytest.mark.slow
def test_second_question_about_a_document_is_served_from_the_cache(client, http):
    hits_before = _hit_tokens(http.get("/metrics").text)
    first = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=6, temperature=0,
                                           messages=document_chat("When did the library open?"))
    second = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=6, temperature=0,
                                            messages=document_chat("Who is the head librarian?"))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens > 200
    assert cached >= second.usage.prompt_tokens // 2  # the document, shared by both prompts
    by_tier = second.model_extra["kvstrata"]["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == cached
    hits_after = _hit_tokens(http.get("/metrics").text)
    assert hits_after - hits_before >= cached + first.usage.prompt_tokens_details.cached_tokens


def _hit_tokens(metrics_text: str) -> float:
    return sum(metric_value(metrics_text, "kvstrata_prefix_cache_hits_tokens_total", f'tier="{tier}"')
               for tier in ("device", "cpu", "disk"))


@pytest.mark.slow
def test_metrics_expose_cache_tiers_ttft_and_queues(http):
    text = http.get("/metrics").text
    assert metric_value(text, "kvstrata_prefix_cache_queries_tokens_total") > 0
    assert metric_value(text, "kvstrata_time_to_first_token_seconds_count") > 0
    assert metric_value(text, "kvstrata_cache_capacity_blocks", 'tier="device"') == 128
    assert metric_value(text, "kvstrata_cache_usage_bytes", 'tier="cpu"') > 0  # written through
    assert metric_value(text, "kvstrata_requests_running") == 0
    assert metric_value(text, "kvstrata_requests_waiting") == 0
    for name in ("kvstrata_cache_evictions_blocks_total", "kvstrata_cache_write_downs_blocks_total",
                 "kvstrata_cache_promotions_blocks_total", "kvstrata_cache_corrupt_blocks_total"):
        metric_value(text, name, 'tier="cpu"')


@pytest.mark.slow
def test_an_idle_server_writes_its_cache_down_to_disk_before_any_shutdown(client, http):
    client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0,
                                   messages=document_chat("How many floors does the library have?"))
    deadline = time.monotonic() + 60
    while metric_value(http.get("/metrics").text, "kvstrata_cache_write_downs_blocks_total", 'tier="disk"') == 0:
        assert time.monotonic() < deadline, "nothing reached the disk tier while the server was idle"
        time.sleep(0.5)


@pytest.mark.slow
def test_cache_salt_keeps_requests_from_sharing_cached_blocks(client):
    messages = document_chat("How many books are there?")

    def cached(salt):
        extra = {"cache_salt": salt} if salt else None
        return client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=1,
                                              temperature=0, extra_body=extra).usage.prompt_tokens_details.cached_tokens

    assert cached(None) > 0  # the document is cached from earlier questions
    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0


LONG_PROMPT = "word " * 9000

BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("body not an object", "/v1/chat/completions", b'[1, 2]', 400, None),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("message without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None),
    ("negative max_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("n above 1", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt longer than the context", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("unknown model in chat", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_openai_error_and_server_keeps_serving(http, path, body, status, param):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    after = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    assert after.status_code == 200


@pytest.mark.slow
def test_sigterm_finishes_the_request_in_flight_writes_the_cache_down_and_exits_0(server, http):
    from kvstrata.tiers.lmdb_store import read_store_stats

    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json={"prompt": "Count: one, two,", "max_tokens": 12,
                                                          "temperature": 0, "ignore_eos": True,
                                                          "stream": True}) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(120)
    assert server.terminate() == 0
    reader.join(60)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut off
    assert "Traceback" not in server.output
    assert read_store_stats(str(server.disk_path))["entries"] > 0
