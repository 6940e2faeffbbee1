"""Many clients at once against one `kvstrata serve` process: continuous batching must not change a
greedy answer, shared prefixes must hit the cache, and a client that hangs up must not leave its
request running."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from server_process import ServerProcess, aborted_requests, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2-135m-instruct"
NUM_CLIENTS = 16
MAX_TOKENS = 8
DOCUMENT = ("The orchard on Kell Hill has apple, pear and plum trees. The pears ripen in September, the "
            "apples in October. Ana runs the cider press; her brother Ivo keeps the bees. ") * 2
QUESTIONS = [f"Question {i}: what is item {i} in a list of fruit from the orchard?" for i in range(NUM_CLIENTS)]


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{DOCUMENT}\n{question}"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("kvstore"), "scheduler.max_num_seqs=16")
    yield process
    process.terminate()
    process.kill()


def test_concurrent_streams_all_finish_with_the_outputs_of_requests_sent_alone(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0, timeout=300)
    alone = [client.chat.completions.create(model=MODEL, messages=messages(q), max_tokens=MAX_TOKENS, temperature=0)
             for q in QUESTIONS]

    async def stream_one(async_client: openai.AsyncOpenAI, question: str) -> tuple[str, str, int]:
        stream = await async_client.chat.completions.create(model=MODEL, messages=messages(question),
                                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                            stream_options={"include_usage": True})
        text, finish_reason, cached = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return "".join(text), finish_reason, cached

    async def stream_all() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0,
                                      timeout=300) as async_client:
            return await asyncio.wait_for(asyncio.gather(*(stream_one(async_client, q) for q in QUESTIONS)), 300)

    together = asyncio.run(stream_all())
    assert len(together) == NUM_CLIENTS
    for (text, finish_reason, cached), single in zip(together, alone):
        assert text == single.choices[0].message.content
        assert finish_reason == single.choices[0].finish_reason
        assert cached > 0  # the shared document (and the sequential pass) are in the cache
    assert all(single.usage.prompt_tokens_details.cached_tokens > 0 for single in alone[1:])


def test_client_that_disconnects_mid_stream_has_its_request_aborted(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        aborted_before = aborted_requests(http.get("/metrics").text)
        body = {"model": MODEL, "messages": messages("Tell me everything."), "max_tokens": 1000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"content"' in line and '"content":""' not in line:
                    break  # a first token arrived: hang up mid-stream
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = http.get("/metrics").text
            if metric_value(text, "kvstrata_requests_running") == 0 and aborted_requests(text) > aborted_before:
                break
            time.sleep(0.2)
        assert metric_value(text, "kvstrata_requests_running") == 0
        assert metric_value(text, "kvstrata_requests_waiting") == 0
        assert aborted_requests(text) == aborted_before + 1
        assert metric_value(text, "kvstrata_cache_usage_blocks", 'tier="device"') == 0  # its blocks were freed
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200

