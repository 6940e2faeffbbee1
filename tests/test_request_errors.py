"""An internal error on the step path fails only the requests it concerns: the engine goes on, the failed request
ends once with an error and its blocks freed, the others get what they get without the fault. On random weights
of a tiny shape (`load_format: dummy`): what is tested is the engine's bookkeeping, not the model."""
from __future__ import annotations

import pytest

from kvstrata import SamplingParams, load_config
from kvstrata.engine.kv_manager import KVCacheManager
from kvstrata.engine.llm import LLM
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.request import RequestFailedError, RequestStatus

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
DOCUMENT = list(range(100, 100 + 4 * BS))
PROMPTS = {"a": DOCUMENT + [7, 8, 9], "b": DOCUMENT + [10, 11], "c": list(range(300, 300 + 2 * BS + 5))}


def tiny_config() -> dict:
    return {"model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32"},
            "cache": {"offload": "write_through",
                      "tiers": {"device": {"size": 64}, "cpu": {"size": 64}, "disk": {"size": 0}}}}


@pytest.fixture
def engine():
    engine = LLMEngine(load_config(tiny_config()))
    yield engine
    engine.close()


class Injected(RuntimeError):
    pass


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], list]:
    """Add the prompts (the document cached first, so that later ones hit it), step until done; the token ids of
    each that finished normally, and every request the steps returned finished (as often as they returned it)."""
    ended = []
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished_requests():
        ended += [r for r in engine.step() if r.is_finished]
    outputs = {r.request_id: r.output_token_ids for r in ended if r.status != RequestStatus.FINISHED_ERROR}
    for request in ended:
        engine.release(request.request_id)
    return outputs, ended


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    kv = engine.kv_manager
    assert not (kv.states or engine.requests)


def warm(engine: LLMEngine) -> None:
    """The document computed and cached on the device (and written through to the CPU tier)."""
    run(engine, {"document": DOCUMENT + [5]})


def fail_lookups_of(prompt: list[int], monkeypatch) -> None:
    """From now on the prefix lookup of any request with this prompt raises."""
    original = KVCacheManager.get_computed_blocks

    def faulty(self, request):
        if request.prompt_token_ids == prompt:
            raise Injected("injected")
        return original(self, request)

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", faulty)


@pytest.mark.parametrize("fault", ["lookup", "admission"])
def test_an_admission_error_fails_that_request_once_and_the_others_get_their_outputs(engine, monkeypatch, caplog,
                                                                                    fault):
    warm(engine)
    expected, _ = run(engine, PROMPTS)
    assert set(expected) == set(PROMPTS)

    # "lookup": the lookup itself raises; "admission": the lookup hands it the document's cached blocks, then
    # giving it slots raises (the blocks it was handed must be let go)
    patched = "get_computed_blocks" if fault == "lookup" else "allocate_slots"
    original = getattr(KVCacheManager, patched)

    def faulty(self, request, *args, **kwargs):
        if request.request_id == "b":
            if fault == "lookup" or args[1:] and args[1]:  # (allocate_slots: at admission, with the prefix)
                raise Injected("injected")
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, patched, faulty)
    caplog.clear()
    outputs, ended = run(engine, PROMPTS)
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "request b failed" in logged[0].getMessage()  # its traceback, logged once
    failed = [r for r in ended if r.request_id == "b"]
    assert len(failed) == 1 and failed[0].status == RequestStatus.FINISHED_ERROR
    doing = "looking up its prefix" if fault == "lookup" else "being admitted"
    assert failed[0].error == f"internal error while {doing} (Injected)"
    assert len(ended) == len(PROMPTS)  # every request ended once
    assert outputs == {k: v for k, v in expected.items() if k != "b"}
    assert_all_blocks_free(engine)
    monkeypatch.undo()
    assert run(engine, {"b": PROMPTS["b"]})[0] == {"b": expected["b"]}  # the engine still serves


def test_an_error_in_the_model_run_fails_the_step_s_requests_and_the_next_request_is_answered(engine, monkeypatch):
    expected, _ = run(engine, {"c": PROMPTS["c"]})
    assert engine.reset_prefix_cache(reset_external=True)
    written = engine.stats()["write_downs"]["cpu"]
    execute = engine.runner.execute
    runs = []

    def faulty(step_input):
        runs.append(step_input)
        if len(runs) == 1:
            raise Injected("injected")
        return execute(step_input)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    _, ended = run(engine, {"c": PROMPTS["c"], "a": PROMPTS["a"]})
    assert sorted((r.request_id, r.status) for r in ended) == [("a", RequestStatus.FINISHED_ERROR),
                                                               ("c", RequestStatus.FINISHED_ERROR)]
    assert ended[0].error == "internal error while computing its step (Injected)"
    assert_all_blocks_free(engine)
    engine.hierarchy.wait_for_write_downs()
    # the blocks the failed step was to compute were cached when allocated: forgotten, so nothing serves them
    assert engine.hierarchy.pool.num_cached_blocks == 0
    again = engine.add_request("again", PROMPTS["c"], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert again.output_token_ids == expected["c"] and again.num_cached_tokens == 0
    # the retry's two full blocks were written down, none of the failed step's
    assert engine.stats()["write_downs"]["cpu"] - written == 2


def test_llm_generate_raises_a_clear_error_for_a_failed_prompt_and_serves_the_next_call(monkeypatch):
    with LLM(tiny_config()) as llm:
        fail_lookups_of(PROMPTS["b"], monkeypatch)
        with pytest.raises(RequestFailedError,
                           match=r"^prompt 1 failed: internal error while looking up its prefix \(Injected\)$"):
            llm.generate([PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]], GREEDY)
        assert_all_blocks_free(llm.engine)
        assert llm.generate(PROMPTS["a"], GREEDY)[0].finish_reason == "length"


# ------------------------------------------------------------------ under the server


def test_under_the_server_an_admission_error_answers_that_client_500_and_the_others_as_without_it(monkeypatch):
    import asyncio
    import json

    import httpx

    from kvstrata.engine.async_engine import AsyncEngine
    from kvstrata.serving.app import build_app
    from kvstrata.serving.metrics import ServingMetrics
    from kvstrata.serving.tokenizer_pool import TokenizerPool

    async_engine = AsyncEngine(LLMEngine(load_config(tiny_config())))
    metrics = async_engine.listener = ServingMetrics(lambda: async_engine.snapshot)
    app = build_app(async_engine, "tiny", metrics=metrics,
                    tokenizers=TokenizerPool(async_engine.engine.tokenizer, 1), max_request_body=1 << 20)
    bodies = {k: {"prompt": prompt, "max_tokens": 6, "temperature": 0} for k, prompt in PROMPTS.items()}
    streamed = {"prompt": PROMPTS["b"], "max_tokens": 6, "temperature": 0, "stream": True}

    async def send_together() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies.values()),
                                             http.post("/v1/completions", json=streamed))
        return dict(zip([*bodies, "streamed"], responses))

    try:
        alone = asyncio.run(send_together())
        assert all(r.status_code == 200 for r in alone.values())
        fail_lookups_of(PROMPTS["b"], monkeypatch)
        faulted = asyncio.run(send_together())
        failed = faulted.pop("b")
        assert failed.status_code == 500
        assert failed.json() == {"error": {
            "message": "the engine failed this request: internal error while looking up its prefix (Injected)",
            "type": "server_error", "param": None, "code": None}}
        # a stream has its status line sent already: the error comes as its event
        events = [json.loads(line[6:]) for line in faulted.pop("streamed").text.splitlines()
                  if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "server_error" and "(Injected)" in events[-1]["error"]["message"]
        for key, response in faulted.items():
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == alone[key].json()["choices"][0]["text"]
        assert async_engine.is_running
        assert 'kvstrata_requests_finished_total{finish_reason="error"} 2.0' in metrics.render().decode()
    finally:
        async_engine.shutdown()
    assert_all_blocks_free(async_engine.engine)


# ------------------------------------------------------------------ the core, faults at random


@pytest.mark.parametrize("prepare", [False, True], ids=["admitting-in-schedule", "preparing-beside-steps"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_random_faults_in_lookups_loads_and_allocations_fail_only_their_requests_and_leak_nothing(
        policy, seed, prepare):
    """The scheduler and KV manager over a gated CPU tier (loads left in flight, tails landing after their heads),
    with internal errors raised at random, for some requests, where a request's lookup starts, where a landed
    load is taken, where its blocks are allocated and cached, and where its tail lands: each such request ends
    once, failed; the others end with the right bytes served; at the end every device block is free and nothing
    is held in the CPU tier."""
    import random

    from test_admission import _compute_step, put_below
    from test_hierarchy import doc, make_stack

    from kvstrata.engine.costs import ReadCost, StepCost
    from kvstrata.engine.request import Request
    from kvstrata.engine.scheduler import Scheduler

    rng = random.Random(seed)
    kv = make_stack(device_blocks=40, cpu_blocks=24, gate_cpu=True, offload="write_through")
    kv.step_cost = StepCost(per_token_s=1e-3)
    kv.read_costs["cpu"] = ReadCost(1024, latency_s=0.0, per_block_s=[1e-4, 8e-3][seed % 2])  # load, or overlap
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, policy=policy)
    bs = kv.block_size
    doomed: set[str] = set()
    armed = [False]

    def faulty(function, where: str):
        def call(request, *args, **kwargs):
            if request.request_id in doomed and rng.random() < 0.3:
                raise Injected(where)
            return function(request, *args, **kwargs)
        return call

    def allocate_slots(request, *args, **kwargs):  # the pool's allocation faults while this request asks
        armed[0] = request.request_id in doomed and rng.random() < 0.3
        try:
            return original_allocate(request, *args, **kwargs)
        finally:
            armed[0] = False

    def get_new_blocks(n):
        if armed[0]:
            raise Injected("get_new_blocks")
        return original_get_new_blocks(n)

    original_allocate, original_get_new_blocks = kv.allocate_slots, kv.pool.get_new_blocks
    kv.allocate_slots, kv.pool.get_new_blocks = allocate_slots, get_new_blocks
    for name in ("_start_prefix", "_account_load", "_cache_full_blocks", "land_tail"):
        setattr(kv, name, faulty(getattr(kv, name), name))

    documents = [doc(100 + d, rng.randint(4, 12) * bs) for d in range(4)]
    gate, done, failed, live = kv.hierarchy.cpu.gate, [], [], []

    def step() -> None:
        for request in _compute_step(kv, scheduler, prepare):
            if len(request.output_token_ids) == request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                live.remove(request)
                done.append(request)
        for request in scheduler.take_failed():
            assert request.status == RequestStatus.FINISHED_ERROR and request.error.endswith("(Injected)")
            live.remove(request)  # (twice: not in `live` any more, and this raises)
            failed.append(request)

    for n in range(250):
        op = rng.random()
        if op < 0.2 and len(live) < 8:
            request = Request(f"r{n}", rng.choice(documents) + doc(1000 + n, rng.randint(1, 20)),
                              SamplingParams(max_tokens=rng.randint(1, 4), temperature=0))
            if rng.random() < 0.4:
                doomed.add(request.request_id)
            scheduler.add_request(request)
            live.append(request)
        elif op < 0.25 and scheduler.running:
            scheduler._preempt(scheduler.running.pop(rng.randrange(len(scheduler.running))))
        elif op < 0.32:
            gate.clear() if gate.is_set() else gate.set()
        elif op < 0.36:  # a document only below the device: its head may be computed while its tail loads
            document = rng.choice(documents)
            put_below(kv, document, len(document) // bs)
            kv.hierarchy.clear_device_cache()  # (refused while a block is in use)
        else:
            step()
            kv.wait_for_loads(timeout=0.001)
    gate.set()  # the loads land (their tails too), the faults go on
    for _ in range(2000):
        if not live:
            break
        kv.wait_for_loads(timeout=1)
        step()
    assert not live, "requests never ended"
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    assert done and failed
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not (kv.states or kv._abandoned)
    assert not kv.hierarchy.cpu.inner._holds


def test_a_fault_while_a_tail_lands_fails_its_request_and_lets_the_tail_go():
    """A head computed while its tail loads (test_admission's overlapping stack); taking the landed tail raises:
    the request ends failed and the tail's blocks, which it did not own yet, are freed with its others."""
    from test_admission import fake_step, overlapping_stack

    kv, scheduler, request = overlapping_stack()
    assert fake_step(kv, scheduler) == [] and kv.barrier(request) is not None  # the head computed
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    account_load = kv._account_load
    kv._account_load = lambda r, load: (_ for _ in ()).throw(Injected("injected"))
    assert fake_step(kv, scheduler) == []
    assert scheduler.take_failed() == [request]
    assert request.error == "internal error while landing its prefix's tail (Injected)"
    kv._account_load = account_load
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and not kv.hierarchy.cpu.inner._holds
    assert not kv.states
