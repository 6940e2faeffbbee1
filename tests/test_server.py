"""The OpenAI-compatible server, end to end: one `kvstrata serve` process (the embedded model, fp32,
small tiers, an API key from the environment) for the whole file, driven by the official `openai`
client and by plain HTTP.

The last test stops the server with SIGTERM; it must stay last in this file."""
from __future__ import annotations

import concurrent.futures
import json
import re
import select
import signal
import socket
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest

from kvstrata.engine.hashing import BlockNaming
from kvstrata.serving import stats_log
from server_process import (REPO, ServerProcess, aborted_requests, metric_value, raw_post, read_response,
                            serve_command, server_env)

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


API_KEY = f"test-key-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("kvstore"), env={"KVSTRATA_API_KEY": API_KEY})
    yield process
    process.kill()  # normally already stopped by the SIGTERM test


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300, headers=AUTH) as http_client:
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


def test_serve_on_a_port_another_server_began_listening_on_while_it_loaded_is_the_same_one_line_error(tmp_path):
    # A second `kvstrata serve` started on the same port binds it too (both set SO_REUSEADDR, neither listens yet):
    # whichever finishes loading second must still say so in one line, not with an OSError's text.
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        process = subprocess.Popen(
            serve_command(f"cache.tiers.disk.path={tmp_path / 'kv'}", "cache.tiers.device.size=64", port=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env(), cwd=REPO)
        try:
            stderr = []
            for line in process.stderr:  # the small device tier's warning: logged after the bind, while it loads
                stderr.append(line)
                if "the device tier holds" in line:
                    break
            other.listen()
            stdout, rest = process.communicate(timeout=300)
        finally:
            process.kill()
    stderr = "".join(stderr) + rest
    assert process.returncode == 2, stdout + stderr
    assert stderr.strip().splitlines()[-1] == (
        f"kvstrata: error: server.port: 127.0.0.1:{port} is already in use (choose another with --port)")
    assert "listening on" not in stdout
    assert "Traceback" not in stdout + stderr


@pytest.mark.slow
def test_startup_banner_names_address_model_and_tier_sizes(server):
    banner = server.output
    assert f"listening on {server.base_url}" in banner
    assert "serving smollm2-135m-instruct (float32 on cpu, " in banner
    for tier in ("device tier:", "cpu tier:", "disk tier:"):
        assert tier in banner
    assert "128 blocks" in banner  # the device tier as configured
    assert re.search(r"disk tier: .* read by \d+ process", banner)  # its reader processes


@pytest.mark.slow
def test_health_and_models_list_the_served_model(http, client):
    health = http.get("/health").json()
    assert health["status"] == "ok"
    naming = BlockNaming.from_json(health["block_naming"])  # what a router hashes this replica's prompts by
    assert naming.model.startswith("smollm2-135m-instruct@") and naming.block_size == 16
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]


@pytest.mark.slow
def test_api_routes_need_the_key_while_health_and_metrics_stay_open(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = anonymous.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get("/v1/models", headers=AUTH).status_code == 200


@pytest.mark.slow
def test_completion_with_openai_client_reports_usage_and_cache_tiers(client):
    # A prompt no other test sends: the first time nothing of it is cached, the second time every
    # whole block of it is, except the last token, which is always computed.
    prompt = f"Request {uuid.uuid4().hex}: list the primary colours and say which two make green."
    first, second = (client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=6,
                                               temperature=0) for _ in range(2))
    choice = second.choices[0]
    assert choice.text == first.choices[0].text and choice.finish_reason in ("stop", "length")
    usage = second.usage
    assert usage.prompt_tokens > 16 and 0 < usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    kv = second.model_extra["kvstrata"]
    assert kv["cached_tokens_by_tier"] == {"device": usage.prompt_tokens_details.cached_tokens, "cpu": 0, "disk": 0, "remote": 0}
    assert kv["ttft_ms"] > 0


RECEIPT_PARTS = ("queue", "lookup", "prefill")


def _receipt_series(metrics_text: str) -> dict[str, float]:
    """The Prometheus series fed by receipts: each part's histogram sum, the per-tier ones, the counters."""
    series = {part: metric_value(metrics_text, f"kvstrata_request_{part}_time_seconds_sum") for part in RECEIPT_PARTS}
    series["count"] = metric_value(metrics_text, "kvstrata_request_queue_time_seconds_count")
    for tier in ("cpu", "disk"):
        series[f"load {tier}"] = metric_value(metrics_text, "kvstrata_request_load_time_seconds_sum", f'tier="{tier}"')
    for tier in ("device", "cpu", "disk"):
        series[f"tokens {tier}"] = metric_value(metrics_text, "kvstrata_request_cached_tokens_total", f'tier="{tier}"')
    series["saved"] = metric_value(metrics_text, "kvstrata_request_prefill_saved_seconds_estimate_total")
    return series


def _streamed_receipt(http, path: str, body: dict) -> dict:
    """The `kvstrata` object of a stream's last chunk (the one with the finish reason)."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] is not None
    return last["kvstrata"]


@pytest.mark.slow
def test_responses_and_streams_carry_a_receipt_that_adds_up_and_metrics_sum_the_receipts(http):
    before = _receipt_series(http.get("/metrics").text)
    prompt = f"Receipt {uuid.uuid4().hex}: which two primary colours make green, and which make orange?"
    receipts = [http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()["kvstrata"],
                _streamed_receipt(http, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0}),
                _streamed_receipt(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                                 "max_tokens": 2, "temperature": 0})]
    for receipt in receipts:
        parts = receipt["queue_ms"] + receipt["lookup_ms"] + sum(receipt["load_ms_by_tier"].values()) + receipt["prefill_ms"]
        assert abs(parts - receipt["ttft_ms"]) <= 0.05 * receipt["ttft_ms"], receipt
        assert receipt["prefill_ms"] > 0
    assert receipts[0]["prefill_saved_ms_estimate"] == 0 and receipts[1]["cached_tokens_by_tier"]["device"] > 0
    assert receipts[1]["prefill_saved_ms_estimate"] > 0  # the same prompt again: its blocks were on the device

    after = _receipt_series(http.get("/metrics").text)
    delta = {name: after[name] - before[name] for name in after}
    tolerance = len(receipts) * 1e-6  # the responses round each part to the microsecond
    assert delta["count"] == len(receipts)
    for part in RECEIPT_PARTS:
        assert delta[part] == pytest.approx(sum(r[f"{part}_ms"] for r in receipts) / 1e3, abs=tolerance), part
    for tier in ("cpu", "disk"):
        assert delta[f"load {tier}"] == pytest.approx(sum(r["load_ms_by_tier"][tier] for r in receipts) / 1e3,
                                                      abs=tolerance)
    for tier in ("device", "cpu", "disk"):
        assert delta[f"tokens {tier}"] == sum(r["cached_tokens_by_tier"][tier] for r in receipts)
    assert delta["saved"] == pytest.approx(sum(r["prefill_saved_ms_estimate"] for r in receipts) / 1e3, abs=tolerance)


@pytest.mark.slow
def test_completion_logprobs_name_each_token_and_its_likeliest_alternatives(client):
    completion = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                           max_tokens=4, temperature=0, logprobs=2)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert "".join(logprobs.tokens).startswith(choice.text)
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        assert 2 <= len(top) <= 3  # the two likeliest, and the sampled token if it is not one of them
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the likeliest


@pytest.mark.slow
def test_streamed_chat_logprobs_cover_every_generated_token(client):
    chunks = list(client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True}))
    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(entry.token for entry in entries).startswith(text)
    for entry in entries:
        assert [alternative.logprob for alternative in entry.top_logprobs] == sorted(
            (alternative.logprob for alternative in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())


@pytest.mark.slow
def test_completion_prompt_may_be_token_ids_or_a_batch_answered_in_order(client):
    token_ids = [504, 3575, 282, 4649, 314]
    single = client.completions.create(model="smollm2-135m-instruct", prompt=token_ids, max_tokens=4, temperature=0)
    assert single.usage.prompt_tokens == len(token_ids)
    assert single.choices[0].text
    batch_of_one = client.completions.create(model="smollm2-135m-instruct", prompt=[token_ids], max_tokens=4,
                                             temperature=0)
    assert batch_of_one.choices[0].text == single.choices[0].text
    other = "The three primary colours are"
    alone = client.completions.create(model="smollm2-135m-instruct", prompt=other, max_tokens=4, temperature=0)
    batch = client.completions.create(model="smollm2-135m-instruct", prompt=[other, token_ids], max_tokens=4,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [alone.choices[0].text, single.choices[0].text]
    assert batch.usage.prompt_tokens == alone.usage.prompt_tokens + len(token_ids)


@pytest.mark.slow
def test_echo_with_logprobs_scores_a_continuation_as_evaluation_harnesses_ask(http):
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs, one token generated
    context = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    generated = http.post("/v1/completions", json={"prompt": context, "max_tokens": 1, "temperature": 0,
                                                   "logprobs": 1}).json()["choices"][0]["logprobs"]
    greedy_logprob = generated["token_logprobs"][0]
    continuation = http.post("/tokenize", json={"prompt": generated["tokens"][0]}).json()["tokens"]
    body = {"prompt": [context + continuation, context], "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True}
    scored, _ = http.post("/v1/completions", json=body).json()["choices"]
    logprobs = scored["logprobs"]
    assert len(logprobs["tokens"]) == len(context) + len(continuation) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # the continuation's prompt log-probability is the one it had when generated after the context
    assert len(continuation) == 1
    assert logprobs["token_logprobs"][len(context)] == pytest.approx(greedy_logprob, abs=1e-3)
    assert max(logprobs["top_logprobs"][len(context)].values()) == pytest.approx(greedy_logprob, abs=1e-3)
    assert scored["text"].startswith("The capital of France is")


@pytest.mark.slow
def test_prompt_logprobs_rank_each_prompt_token_as_vllm_and_agree_with_an_echo(http):
    context = http.post("/tokenize", json={"prompt": "The capital of France is Paris; of Italy, Rome."}).json()["tokens"]
    body = {"prompt": context, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "echo": True, "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    by_token, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert by_token[0] is None and len(by_token) == len(context)
    for k, token in enumerate(context[1:], start=1):
        mine = by_token[k][str(token)]
        assert mine["logprob"] == echoed["token_logprobs"][k] and mine["decoded_token"] == echoed["tokens"][k]
        others = sorted((e["rank"], e["logprob"]) for t, e in by_token[k].items() if t != str(token))
        if mine["rank"] <= 2:  # the token is one of the two likeliest: listed once
            assert len(others) == 1 and others[0][0] == 3 - mine["rank"]
        else:
            assert [rank for rank, _ in others] == [1, 2] and others[1][1] >= mine["logprob"]
    assert any(by_token[k][str(t)]["rank"] > 2 for k, t in enumerate(context[1:], start=1))


@pytest.mark.slow
def test_answers_scored_at_once_on_one_document_compute_it_once(http):
    served_before = metric_value(http.get("/metrics").text, "kvstrata_prompt_logprob_cache_served_blocks_total")
    context = http.post("/tokenize", json={"messages": document_chat(f"Which year? {uuid.uuid4().hex}")}).json()
    answers = [http.post("/tokenize", json={"prompt": a}).json()["tokens"] for a in (" 1921", " 1987", " 2004")]
    body = {"prompt": [context["tokens"] + a for a in answers], "max_tokens": 1, "temperature": 0, "logprobs": 0,
            "echo": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two clients, each scoring the three answers
        responses = list(pool.map(lambda _: http.post("/v1/completions", json=body).json(), range(2)))
    scores = []
    for response in responses:
        assert response["usage"]["prompt_tokens"] == sum(context["count"] + len(a) for a in answers)
        scores.append([sum(c["logprobs"]["token_logprobs"][context["count"]:-1]) for c in response["choices"]])
        assert all(len(c["logprobs"]["tokens"]) == context["count"] + len(a) + 1
                   for c, a in zip(response["choices"], answers))
    assert scores[0] == pytest.approx(scores[1], abs=1e-3)
    # six requests on one context at once: one computes it, the others wait for its blocks' log-probabilities
    cached = sorted(c["kvstrata"]["cached_tokens_by_tier"]["device"] for r in responses for c in r["choices"])
    assert cached[0] == 0 and all(n >= (context["count"] // 16 - 2) * 16 for n in cached[1:]), cached
    served = metric_value(http.get("/metrics").text, "kvstrata_prompt_logprob_cache_served_blocks_total")
    assert served - served_before >= 5 * (context["count"] // 16 - 2)


@pytest.mark.slow
def test_n_choices_share_the_prompt_computed_once_and_a_seed_makes_them_reproducible(client):
    prompt = f"Story {uuid.uuid4().hex}: once upon a time, in a village by the sea, there lived"
    ask = dict(model="smollm2-135m-instruct", prompt=prompt, max_tokens=12, temperature=1.0, n=3, seed=11)
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3  # each choice samples with its own seed
    assert [c.text for c in again.choices] == texts
    # A new prompt: one choice computes it, and the others find its blocks on the device.
    full_blocks = (first.usage.prompt_tokens - 1) // 16 * 16
    devices = sorted(c.model_extra["kvstrata"]["cached_tokens_by_tier"]["device"] for c in first.choices)
    assert devices == [0, full_blocks, full_blocks]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks


@pytest.mark.slow
def test_tokenize_counts_what_a_request_computes_and_detokenize_gives_the_text_back(client, http):
    messages = document_chat("When did the library open?")
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=1,
                                           temperature=0)
    assert tokenized["count"] == reply.usage.prompt_tokens == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 8192
    prompt = "The Harbor Street library opened in 1921."
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == prompt
    assert http.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"


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


def test_after_a_prefix_cache_reset_a_document_is_served_from_the_cpu_tier(client, http, server):
    """How a user measures a CPU-tier hit over HTTP: the device forgets, the tier below still holds."""
    messages = document_chat("What was rebuilt with a glass roof?")
    client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0, messages=messages)
    assert httpx.post(f"{server.base_url}/reset_prefix_cache").status_code == 401  # it needs the key
    reset = http.post("/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json() == {"object": "prefix_cache.reset", "tiers": ["device"]}
    again = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0,
                                           messages=messages)
    by_tier = again.model_extra["kvstrata"]["cached_tokens_by_tier"]
    assert by_tier["device"] == 0 and by_tier["cpu"] >= again.usage.prompt_tokens // 2


def test_a_prefix_cache_reset_while_a_request_runs_is_refused_with_409(http):
    body = {"model": "smollm2-135m-instruct", "prompt": "Count from one to a hundred:", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # kept: dropping the iterator would close the stream, aborting the request
        next(lines)  # the request is running
        refused = http.post("/reset_prefix_cache")
    error = refused.json()["error"]
    assert refused.status_code == 409 and error["code"] == "server_busy" and "\n" not in error["message"]
    deadline = time.monotonic() + 60  # the stream closed: its request is aborted, the server idle again
    while metric_value(http.get("/metrics").text, "kvstrata_requests_running") != 0:
        assert time.monotonic() < deadline, "the closed stream's request still runs"
        time.sleep(0.1)
    assert http.post("/reset_prefix_cache").status_code == 200


def _hit_tokens(metrics_text: str) -> float:
    return sum(metric_value(metrics_text, "kvstrata_prefix_cache_hits_tokens_total", f'tier="{tier}"')
               for tier in ("device", "cpu", "disk"))


@pytest.mark.slow
def test_a_reset_with_reset_external_leaves_no_tier_holding_a_document(client, http):
    """vLLM's flag, which benchmarks send before each run to start cold: the CPU and disk tiers forget too."""
    messages = document_chat("Who started the reading club?")
    client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0, messages=messages)
    reset = http.post("/reset_prefix_cache", params={"reset_external": "true"})
    assert reset.status_code == 200
    assert reset.json() == {"object": "prefix_cache.reset", "tiers": ["device", "cpu", "disk"]}
    again = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2, temperature=0,
                                           messages=messages)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    bad = http.post("/reset_prefix_cache", params={"reset_external": "maybe"})
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "reset_external" and "\n" not in error["message"]


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
    assert metric_value(text, "kvstrata_cache_disk_read_processes") >= 1  # by default one per fill thread
    assert metric_value(text, "kvstrata_cache_disk_blocks_read_by_processes_total") >= 0


def test_metrics_expose_vllm_named_series_beside_ours(client, http):
    """Dashboards and autoscalers built for vLLM read these names, labelled with the served model."""
    client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=1, temperature=0,
                                   messages=document_chat("Who keeps the keys?"))
    text = http.get("/metrics").text
    label = 'engine="0",model_name="smollm2-135m-instruct"'
    queries = metric_value(text, "vllm:prefix_cache_queries_total", label)
    assert queries == metric_value(text, "kvstrata_prefix_cache_queries_tokens_total") > 0
    hits = metric_value(text, "vllm:prefix_cache_hits_total", label)
    assert hits == metric_value(text, "kvstrata_prefix_cache_hits_tokens_total", 'tier="device"')
    assert metric_value(text, "vllm:external_prefix_cache_queries_total", label) == queries - hits
    assert metric_value(text, "vllm:external_prefix_cache_hits_total", label) >= 0
    assert 0 <= metric_value(text, "vllm:kv_cache_usage_perc", label) <= 1
    assert metric_value(text, "vllm:num_requests_running", label) == 0
    assert metric_value(text, "vllm:num_requests_waiting", label) == 0
    assert metric_value(text, "vllm:num_preemptions_total", label) == 0  # a lone request has room
    for series in stats_log.SERIES:  # the periodic stats line is read from these
        assert f"\n{series}" in text, series
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", label) == \
        metric_value(text, "kvstrata_time_to_first_token_seconds_count")


VERDICT = {"type": "object", "properties": {"opened": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                          "rebuilt_wing": {"enum": ["east", "west", "north", "south"]}},
           "required": ["opened", "rebuilt_wing"], "additionalProperties": False}


@pytest.mark.slow
def test_a_json_schema_response_format_gives_an_answer_that_follows_it(client):
    """OpenAI's structured outputs, on a question about a cached document."""
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=40, temperature=0, messages=document_chat(
            "When did the library open, and which wing was rebuilt? Answer in JSON."),
        response_format={"type": "json_schema", "json_schema": {"name": "facts", "schema": VERDICT, "strict": True}})
    choice = answer.choices[0]
    value = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and set(value) == {"opened", "rebuilt_wing"}
    assert 1000 <= value["opened"] <= 2100 and value["rebuilt_wing"] in ("east", "west", "north", "south")


def test_a_json_schema_the_server_cannot_follow_is_a_400_naming_response_format(http):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"properties": {"x": {"type": "nope"}}}}}}
    refused = http.post("/v1/chat/completions", json=body)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "response_format" and "\n" not in error["message"]
    assert error["message"].startswith("response_format: the JSON schema cannot be followed")


ANSWER_METRICS = ("kvstrata_prompt_tokens_total", "kvstrata_generation_tokens_total",
                  "kvstrata_inter_token_latency_seconds_count", "kvstrata_e2e_request_latency_seconds_count")


def test_metrics_count_each_answers_tokens_the_gaps_between_them_and_its_latency(client, http):
    """vLLM's request figures: what a dashboard reads for throughput and inter-token latency."""
    def read() -> dict[str, float]:
        text = http.get("/metrics").text
        return {name: metric_value(text, name) for name in ANSWER_METRICS}

    before = read()
    answer = client.completions.create(model="smollm2-135m-instruct", prompt="Count to ten:", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    after = read()
    grew = [after[name] - before[name] for name in ANSWER_METRICS]
    assert grew == [answer.usage.prompt_tokens, 5, 4, 1]  # four gaps between five tokens; one request


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
    ("n of 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt longer than the context", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("unknown model in chat", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages.0.content"),
    ("a penalty out of range", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("a stop token outside the vocabulary", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]},
     400, "stop_token_ids"),
    ("a biased token outside the vocabulary", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
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
@pytest.mark.parametrize("n", [1, 3])
def test_client_that_hangs_up_on_a_non_streaming_request_has_it_aborted(http, server, n):
    aborted_before = aborted_requests(http.get("/metrics").text)
    body = json.dumps({"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True, "n": n}).encode()
    with raw_post(server.base_url, "/v1/completions", body, AUTH):
        _wait_for_metrics(http, lambda text: metric_value(text, "kvstrata_requests_running") == n)
    # hung up: every choice must stop now, not after its 1000 tokens
    text = _wait_for_metrics(http, lambda text: aborted_requests(text) >= aborted_before + n)
    assert aborted_requests(text) == aborted_before + n
    assert metric_value(text, "kvstrata_requests_running") == 0


def _wait_for_metrics(http, condition, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        if condition(text):
            return text
        assert time.monotonic() < deadline, "the server's metrics never showed the expected state"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_huge_prompt_being_tokenized_does_not_hold_up_health(http, server):
    # ~2 MB of text: seconds of tokenizing (then a 400: far beyond the context), within the body limit.
    body = json.dumps({"prompt": "hello world " * 180_000, "max_tokens": 1}).encode()
    with raw_post(server.base_url, "/v1/completions", body, AUTH) as huge:
        time.sleep(0.5)  # the server has read the body (loopback: milliseconds) and is tokenizing it
        assert http.get("/health").status_code == 200
        answered_before_health = select.select([huge], [], [], 0)[0]
        assert not answered_before_health, "/health waited for the huge prompt's tokenization"
        assert read_response(huge)[0] == 400


@pytest.mark.slow
def test_body_larger_than_the_limit_is_refused_before_it_is_sent(server):
    declared = 64 * 1024**2  # the default limit is 32MiB; nothing of the body is ever sent
    with raw_post(server.base_url, "/v1/completions", b"", AUTH, content_length=declared) as sock:
        status, body = read_response(sock)
    assert status == 413
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "server.max_request_body" in error["message"]


@pytest.mark.slow
def test_sigterm_drains_refusing_new_requests_writes_the_cache_down_and_exits_0(server, http):
    from kvstrata.tiers.lmdb_store import read_store_stats

    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json={"prompt": "Count: one, two,", "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True,
                                                          "stream": True}) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(120)
    server.process.send_signal(signal.SIGTERM)
    refused = _post_until_refused(http)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert http.get("/health").status_code == 503  # a load balancer stops sending
    assert server.wait() == 0  # once the stream has finished (a second signal would cut it short)
    reader.join(60)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut off
    assert "Traceback" not in server.output
    assert API_KEY not in server.output
    assert server.lines[-1] == f"kvstrata: stopped; cache written down to {server.disk_path}"
    assert read_store_stats(str(server.disk_path))["entries"] > 0


def _post_until_refused(http) -> httpx.Response:
    """A new request after SIGTERM (the signal takes a moment to land: until then one is served)."""
    deadline = time.monotonic() + 60
    while True:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
