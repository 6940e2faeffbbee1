"""Pinned and preloaded documents: the tiers' pins, and documents through the LLM API and HTTP.

Model-level tests run the embedded model on tiny tiers (a few blocks each), so that a working set
several times the tiers is about a thousand tokens.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.engine.documents import PinLimitError
from kvstrata.engine.prompts import document_messages, document_prefix_messages, render_chat, render_document
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers.disk import DiskTier
from tier_cases import BF16, key, payload, tokens

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
HANDBOOK = ("The Zorblat handbook says the blue door opens at nine, the red door at ten, and the green door "
            "never opens on Sundays. Visitors sign in at the desk beside the fountain.")
MEMO = ("The quarterly memo says the canteen closes early on Fridays and that parking permits are renewed "
        "every March at the east office, next to the post room.")


def put(tier, ids) -> None:
    tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(BF16, i) for i in ids])


def held(tier, ids) -> list[int]:
    return [i for i in ids if tier.contains(key(i))]


# ---------------------------------------------------------------------------------------------
# The tiers' pins


def test_cpu_tier_keeps_pinned_blocks_through_a_working_set_ten_times_its_size_until_unpinned():
    tier = CpuTier(BF16, capacity_blocks=4)
    put(tier, [1, 2])
    tier.pin("doc", [key(1), key(2)])
    put(tier, range(100, 140))
    assert held(tier, [1, 2]) == [1, 2]
    assert tier.stats().pinned_blocks == 2
    assert tier.unpin("doc") and not tier.unpin("doc")
    put(tier, range(200, 204))
    assert held(tier, [1, 2]) == []


def test_cpu_tier_block_pinned_by_two_owners_stays_until_both_unpin():
    tier = CpuTier(BF16, capacity_blocks=3)
    put(tier, [1, 2])
    tier.pin("a", [key(1), key(2)])
    tier.pin("b", [key(2)])
    tier.unpin("a")
    put(tier, range(100, 110))
    assert held(tier, [1, 2]) == [2]
    assert set(tier.pins()) == {"b"}


def test_cpu_tier_pins_a_block_that_arrives_after_the_pin():
    tier = CpuTier(BF16, capacity_blocks=2)
    tier.pin("doc", [key(1)])
    put(tier, [1])
    put(tier, range(100, 110))
    assert held(tier, [1]) == [1]


def test_disk_tier_keeps_pinned_blocks_through_eviction_and_a_restart_until_unpinned(tmp_path):
    record = DiskTier(BF16, str(tmp_path / "probe"), 1 << 20).codec.record_nbytes
    tier = DiskTier(BF16, str(tmp_path / "kv"), 4 * record)
    put(tier, [1, 2])
    tier.pin("doc", [key(1), key(2)], {"num_tokens": 8})
    put(tier, range(100, 140))
    tier.flush()
    assert held(tier, [1, 2]) == [1, 2]
    tier.close()

    tier = DiskTier(BF16, str(tmp_path / "kv"), 4 * record)
    assert tier.pins()["doc"].block_hashes == (key(1), key(2))
    assert tier.pins()["doc"].info == {"num_tokens": 8}
    assert tier.stats().pinned_blocks == 2
    put(tier, range(200, 240))
    tier.flush()
    assert held(tier, [1, 2]) == [1, 2]
    assert tier.unpin("doc")
    put(tier, range(300, 304))
    tier.flush()
    assert held(tier, [1, 2]) == []
    assert tier.stats().used_bytes <= 4 * record
    tier.close()


def test_disk_tier_clear_drops_pins_too(tmp_path):
    tier = DiskTier(BF16, str(tmp_path / "kv"), 1 << 20)
    put(tier, [1])
    tier.pin("doc", [key(1)])
    tier.clear()
    assert tier.pins() == {} and not tier.contains(key(1)) and tier.stats().pinned_blocks == 0
    tier.close()


# ---------------------------------------------------------------------------------------------
# Through the engine (embedded model)


@pytest.fixture
def tiny_config(tmp_path):
    def make(**cache) -> dict:
        # always_load: a 4-block document is cheap enough to recompute that the auto policy, timing a busy machine,
        # sometimes does (1 run in 8 with four at once); these tests are about what the tiers hold
        base = {"tiers": {"device": {"size": 12}, "cpu": {"size": 6},
                          "disk": {"path": str(tmp_path / "kv"), "size": 8}}, "pin_share": 0.5,
                "load_policy": "always_load"}
        base.update(cache)
        return {"model": {"dtype": "float32", "device": "cpu"}, "cache": base}
    return make


def fill(llm: LLM, num_blocks: int, seed: int = 0) -> None:
    """Push `num_blocks` blocks of unrelated prompts through the cache (6 blocks per prompt)."""
    for i in range(num_blocks // 6):
        llm.generate([[2000 + seed * 5000 + 97 * i + j for j in range(6 * 16 + 1)]], ONE_TOKEN)


def question(doc: str, q: str = "When does the blue door open?") -> list[dict]:
    return document_messages(doc, q)


@pytest.mark.slow
def test_question_token_ids_start_with_the_documents_full_blocks(embedded_model_fp32):
    tokenizer = embedded_model_fp32.tokenizer
    document = render_document(tokenizer, messages=document_prefix_messages(HANDBOOK))
    full = document.num_stable_tokens // 16 * 16
    assert full >= 32
    for q in ("When does the blue door open?", "1. List the doors.", "\n\nwhere?"):
        assert render_chat(tokenizer, question(HANDBOOK, q))[:full] == document.token_ids[:full]
    prompt_doc = render_document(tokenizer, prompt=HANDBOOK)
    prompt_full = prompt_doc.num_stable_tokens // 16 * 16
    assert tokenizer(HANDBOOK + " Question: why?")["input_ids"][:prompt_full] == prompt_doc.token_ids[:prompt_full]
    # a chat whose last message is left open (vLLM's continue_final_message) is the document itself
    open_chat = render_chat(tokenizer, document_prefix_messages(HANDBOOK), add_generation_prompt=False,
                            continue_final_message=True)
    assert open_chat == document.token_ids


@pytest.mark.slow
def test_pinned_document_survives_a_working_set_three_times_the_tiers_and_a_restart(embedded_model_fp32, tiny_config):
    config = tiny_config()
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        doc = llm.cache_document(document_prefix_messages(HANDBOOK))
        assert doc.pinned and doc.num_cached_tokens == 48
        assert doc.blocks_by_tier == {"device": 3, "cpu": 3, "disk": 3}
        fill(llm, 3 * (12 + 6 + 8))  # every unpinned block is evicted from every tier more than once
        [listed] = llm.list_documents()
        assert listed.id == doc.id and listed.blocks_by_tier["cpu"] == listed.blocks_by_tier["disk"] == 3
        out = llm.chat(question(HANDBOOK), ONE_TOKEN)[0]
        assert out.cached_tokens == 48 and out.cached_tokens_by_tier["device"] == 0
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        [listed] = llm.list_documents()
        assert (listed.id, listed.pinned, listed.num_tokens) == (doc.id, True, doc.num_tokens)
        out = llm.chat(question(HANDBOOK, "Who signs in at the desk?"), ONE_TOKEN)[0]
        # the document's blocks, and the block after them that the first question cached (the
        # document's last tokens and the start of "Question: ..."), all from disk
        assert out.cached_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 64, "remote": 0}
        # After the restart the CPU tier pins the document's blocks as they come up from disk.
        fill(llm, 36, seed=1)  # more blocks than all three tiers hold
        assert llm.list_documents()[0].blocks_by_tier["cpu"] == 3

        llm.unpin_document(doc.id)
        assert llm.list_documents() == []
        fill(llm, 36, seed=2)
        assert llm.chat(question(HANDBOOK), ONE_TOKEN)[0].cached_tokens == 0


@pytest.mark.slow
def test_a_reset_of_every_tier_forgets_cached_and_pinned_documents_for_good(embedded_model_fp32, tiny_config):
    """`reset_prefix_cache(reset_external=True)` (vLLM's flag): the cold state a benchmark starts from.
    A device reset alone leaves the document below; the full one leaves nothing, not even after a restart."""
    config = tiny_config()
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        llm.cache_document(document_prefix_messages(HANDBOOK))
        llm.chat(question(HANDBOOK, "Who signs in at the desk?"), ONE_TOKEN)
        assert llm.reset_prefix_cache().tiers == ["device"]
        assert llm.chat(question(HANDBOOK), ONE_TOKEN)[0].cached_tokens == 64  # from the tiers below
        reset = llm.reset_prefix_cache(reset_external=True)
        assert reset and reset.tiers == ["device", "cpu", "disk"] and reset.not_cleared == []
        assert llm.list_documents() == []
        stats = llm.stats()["tiers"]
        assert all(stats[t]["used_blocks"] == 0 and stats[t]["pinned_blocks"] == 0 for t in ("cpu", "disk"))
        assert llm.chat(question(HANDBOOK), ONE_TOKEN)[0].cached_tokens == 0
        llm.reset_prefix_cache(reset_external=True)  # what that question cached goes too
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        assert llm.list_documents() == []
        assert llm.chat(question(HANDBOOK), ONE_TOKEN)[0].cached_tokens == 0


@pytest.mark.slow
def test_preload_makes_the_first_question_on_a_document_a_hit(embedded_model_fp32, tiny_config, tmp_path):
    (tmp_path / "handbook.txt").write_text(HANDBOOK)
    config = tiny_config(preload=[{"file": str(tmp_path / "handbook.txt")}])
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        [doc] = llm.list_documents()
        assert doc.pinned
        out = llm.chat(question(HANDBOOK), ONE_TOKEN)[0]
        assert out.cached_tokens == doc.num_cached_tokens >= 48


@pytest.mark.slow
def test_pinning_beyond_the_pin_share_is_refused_before_any_work(embedded_model_fp32, tiny_config):
    with LLM(tiny_config(), loaded_model=embedded_model_fp32) as llm:
        llm.cache_document(document_prefix_messages(HANDBOOK))  # 3 of the CPU tier's 3 allowed blocks
        queries = llm.stats()["prefix_cache"]["query_tokens"]
        with pytest.raises(PinLimitError, match=r"^cache.pin_share: .* cpu tier, more than the 3 of its 6") as exc:
            llm.cache_document(document_prefix_messages(MEMO))
        assert "\n" not in str(exc.value)
        assert llm.stats()["prefix_cache"]["query_tokens"] == queries
        unpinned = llm.cache_document(document_prefix_messages(MEMO), pin=False)  # caching without a pin is fine
        assert not unpinned.pinned and len(llm.list_documents()) == 2


@pytest.mark.slow
def test_a_remote_tier_gets_a_pinned_documents_blocks_but_neither_holds_nor_limits_the_pin(embedded_model_fp32,
                                                                                         tiny_config):
    # The server evicts by its own policy, so the remote tier keeps no pin and has no capacity to share out:
    # the pin share is the CPU and disk tiers' alone, and pinning needs one of them.
    from valkey_server import ValkeyServer
    with ValkeyServer() as server:
        remote = {"url": server.url, "timeout": "500ms"}
        config = tiny_config()
        config["cache"]["tiers"]["remote"] = remote
        with LLM(config, loaded_model=embedded_model_fp32) as llm:
            doc = llm.cache_document(document_prefix_messages(HANDBOOK))
            llm.engine.hierarchy.remote.flush()
            [listed] = llm.list_documents()
            assert doc.pinned and listed.blocks_by_tier["remote"] == 3
            with pytest.raises(PinLimitError, match=r"cpu tier, more than the 3 of its 6"):
                llm.cache_document(document_prefix_messages(MEMO))
        with LLM({**config, "cache": {"tiers": {"device": {"size": 12}, "remote": remote}}},
                 loaded_model=embedded_model_fp32) as llm:
            with pytest.raises(ValueError, match=r"^pin: pinning needs a CPU or disk tier"):
                llm.cache_document(document_prefix_messages(MEMO))
            assert not llm.cache_document(document_prefix_messages(MEMO), pin=False).pinned


@pytest.mark.slow
def test_salts_keep_two_tenants_pinned_documents_apart(embedded_model_fp32, tiny_config):
    with LLM(tiny_config(pin_share=1.0), loaded_model=embedded_model_fp32) as llm:
        a = llm.cache_document(document_prefix_messages(HANDBOOK), cache_salt="tenant-a")
        b = llm.cache_document(document_prefix_messages(HANDBOOK), cache_salt="tenant-b")
        assert a.id != b.id and a.salted and b.salted
        fill(llm, 60)
        assert llm.chat(question(HANDBOOK), ONE_TOKEN, cache_salt="tenant-a")[0].cached_tokens == 48
        assert llm.chat(question(HANDBOOK), ONE_TOKEN, cache_salt="tenant-c")[0].cached_tokens == 0
        llm.unpin_document(a.id)
        fill(llm, 36, seed=1)  # more blocks than all three tiers hold
        assert llm.chat(question(HANDBOOK), ONE_TOKEN, cache_salt="tenant-a")[0].cached_tokens == 0
        assert llm.chat(question(HANDBOOK), ONE_TOKEN, cache_salt="tenant-b")[0].cached_tokens == 48


# ---------------------------------------------------------------------------------------------
# HTTP


@pytest.fixture
def http_app(embedded_model_fp32, tiny_config):
    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.engine.config import load_config
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.serving.app import build_app
    from kvstrata.serving.metrics import ServingMetrics
    from kvstrata.serving.tokenizer_pool import TokenizerPool

    engine = AsyncEngine(LLMEngine(load_config(tiny_config()), loaded=embedded_model_fp32))
    app = build_app(engine, "smollm2", metrics=ServingMetrics(lambda: engine.snapshot),
                    tokenizers=TokenizerPool(embedded_model_fp32.tokenizer, 1), max_request_body=1 << 20)
    yield app
    engine.shutdown()


def call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.request(method, path, json=body)
    return asyncio.run(go())


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    assert error["param"] == param and (code is None or error["code"] == code)


@pytest.mark.slow
def test_documents_over_http_pin_list_hit_and_unpin(http_app):
    made = call(http_app, "POST", "/v1/cache/documents", {"messages": document_prefix_messages(HANDBOOK)})
    assert made.status_code == 200, made.text
    doc = made.json()
    assert doc["object"] == "cache.document" and doc["pinned"] and doc["num_cached_tokens"] == 48
    assert doc["blocks_by_tier"]["cpu"] == doc["blocks_by_tier"]["disk"] == 3
    again = call(http_app, "POST", "/v1/cache/documents", {"messages": document_prefix_messages(HANDBOOK)})
    assert again.json()["id"] == doc["id"]
    assert [d["id"] for d in call(http_app, "GET", "/v1/cache/documents").json()["data"]] == [doc["id"]]

    answer = call(http_app, "POST", "/v1/chat/completions", {"messages": question(HANDBOOK), "max_tokens": 1})
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48

    over = call(http_app, "POST", "/v1/cache/documents", {"messages": document_prefix_messages(MEMO)})
    assert_openai_error(over, 409, "pin", "pin_limit_exceeded")
    deleted = call(http_app, "DELETE", f"/v1/cache/documents/{doc['id']}")
    assert deleted.json() == {"id": doc["id"], "object": "cache.document.deleted", "deleted": True}
    assert call(http_app, "GET", "/v1/cache/documents").json()["data"] == []
    assert_openai_error(call(http_app, "DELETE", f"/v1/cache/documents/{doc['id']}"), 404, "document_id",
                        "document_not_found")


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"prompt": HANDBOOK, "messages": document_prefix_messages(HANDBOOK)}, "messages"),
    ({"prompt": "too short"}, "prompt"),
    ({"messages": []}, "messages"),
    ({"prompt": HANDBOOK, "pin": "maybe"}, "pin"),
    ({"prompt": HANDBOOK, "colour": "red"}, "colour"),
], ids=["neither", "both", "under one block", "no messages", "pin not a bool", "unknown field"])
def test_bad_document_requests_get_openai_shaped_400s(http_app, body, param):
    assert_openai_error(call(http_app, "POST", "/v1/cache/documents", body), 400, param)


@pytest.fixture
def served(http_app):
    """`http_app` listening on a free local port (the CLI talks HTTP to a running server)."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(http_app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join()


@pytest.mark.slow
def test_cache_documents_cli_adds_lists_and_unpins_on_a_running_server(served, tmp_path, capsys):
    from kvstrata.cli import main

    (tmp_path / "handbook.txt").write_text(HANDBOOK)
    assert main(["cache", "documents", "add", str(tmp_path / "handbook.txt"), "--url", served]) == 0
    added = capsys.readouterr().out
    doc_id = added.split()[0]
    assert doc_id.startswith("doc-") and "pinned" in added and "cpu 3, disk 3" in added
    assert main(["cache", "documents", "list", "--url", served]) == 0
    assert capsys.readouterr().out.startswith(doc_id)
    assert main(["cache", "documents", "unpin", doc_id, "--url", served]) == 0
    assert capsys.readouterr().out.strip() == f"unpinned {doc_id}"
    assert main(["cache", "documents", "unpin", doc_id, "--url", served]) == 2
    assert capsys.readouterr().err.strip() == f"kvstrata: error: no document with id '{doc_id}'"
    (tmp_path / "memo.txt").write_text(MEMO)
    main(["cache", "documents", "add", str(tmp_path / "handbook.txt"), "--url", served])
    assert main(["cache", "documents", "add", str(tmp_path / "memo.txt"), "--url", served]) == 2
    assert capsys.readouterr().err.startswith("kvstrata: error: cache.pin_share: pinning doc-")


def test_cache_documents_cli_without_a_server_is_one_line_error(tmp_path, capsys):
    from kvstrata.cli import main

    (tmp_path / "handbook.txt").write_text(HANDBOOK)
    assert main(["cache", "documents", "list", "--url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvstrata: error: cannot reach the server at http://127.0.0.1:9") and err.count("\n") == 1
    assert main(["cache", "documents", "add", str(tmp_path / "none.txt"), "--url", "http://127.0.0.1:9"]) == 2
    assert "FILE: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("cache, message", [
    (lambda doc: {"preload": [{"file": "/no/such/handbook.txt"}]},
     "cache.preload.0.file: no such file '/no/such/handbook.txt'"),
    (lambda doc: {"preload": [{"file": doc, "pinned": True}]}, "cache.preload.0.pinned: unknown key"),
    (lambda doc: {"preload": [{"file": doc, "pin": "yes"}]}, "cache.preload.0.pin: expected true or false, got 'yes'"),
    (lambda doc: {"preload": "handbook.txt"},
     "cache.preload: expected a list of {file, cache_salt, pin}, got 'handbook.txt'"),
    (lambda doc: {"preload": [{"file": doc}], "enable_prefix_caching": False},
     "cache.preload: needs cache.enable_prefix_caching: true"),
    (lambda doc: {"pin_share": 0}, "cache.pin_share: expected a fraction in (0, 1], got 0"),
    (lambda doc: {"pin_share": 1.5}, "cache.pin_share: expected a fraction in (0, 1], got 1.5"),
], ids=["missing file", "unknown key", "pin not a bool", "not a list", "caching off", "share 0", "share above 1"])
def test_bad_preload_or_pin_share_is_one_line_naming_the_key(tmp_path, cache, message):
    from kvstrata.engine.config import ConfigError, load_config

    doc = tmp_path / "handbook.txt"
    doc.write_text(HANDBOOK)
    with pytest.raises(ConfigError) as exc:
        load_config({"cache": cache(str(doc))})
    assert str(exc.value) == message
