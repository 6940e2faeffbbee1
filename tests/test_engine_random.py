"""Caching, batching and preemption never change what a request gets, whatever it asks for; and the
KV events of all that movement name every block's parent truly, in every medium.

Seeded random batches of requests with random sampling parameters (greedy and seeded sampling,
penalties, logit bias, stops, min_tokens, logprobs, prompt_logprobs, n, structured outputs, tenants'
salts) on prompts that share random prefixes of a few real documents, through engines with small
random tiers, step budgets, sequence limits and both scheduling policies (so requests are chunked,
evicted, spilled, promoted and preempted), each against the same request sent alone to an engine
with caching off.
The embedded model in float32 on the CPU, where hits give exactly the uncached outputs.
"""
from __future__ import annotations

import math
import random

import pytest
from pydoc_data.topics import topics

from kvstrata import LLM, SamplingParams, StructuredOutputsParams
from kvstrata.tiers.block_events import BlockStored

pytestmark = pytest.mark.slow

VOCAB = 49152
QUESTIONS = [" What is it?", " Explain briefly.", " Why", " List the parts:"]


@pytest.fixture(scope="module")
def reference(embedded_model_fp32):
    llm = LLM({"model": {"device": "cpu", "dtype": "float32"},
               "cache": {"enable_prefix_caching": False, "tiers": {"device": {"size": 128}}}},
              loaded_model=embedded_model_fp32)
    yield llm
    llm.close()


def engine_config(rng: random.Random, store: str) -> dict:
    return {"model": {"device": "cpu", "dtype": "float32"},
            "cache": {"tiers": {"device": {"size": rng.choice([40, 64])}, "cpu": {"size": rng.choice([0, 30, 80])},
                                "disk": {"path": store, "size": rng.choice([0, 50, 400])}},
                      "offload": rng.choice(["write_through", "on_evict"]),
                      "load_policy": rng.choice(["auto", "always_load", "always_recompute"])},
            "scheduler": {"policy": rng.choice(["fcfs", "uncached_first"]),
                          "max_num_batched_tokens": rng.choice([64, 256, 2048]), "max_num_seqs": rng.choice([2, 16])}}


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["answer", "n"]}


def random_params(rng: random.Random) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(1, 6)}
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1000))
        maybe = {"top_k": [1, 5, 50], "top_p": [0.5, 0.9], "min_p": [0.05, 0.2]}
        kw.update({k: rng.choice(v) for k, v in maybe.items() if rng.random() < 0.3})
    maybe = {"presence_penalty": [-1.0, 1.0], "frequency_penalty": [0.5, 1.5], "repetition_penalty": [0.8, 1.3],
             "logit_bias": [{rng.randrange(VOCAB): rng.choice([-100.0, 5.0, 100.0])}],
             "stop": [".", " the", "\n", ["a", "e"]], "stop_token_ids": [[rng.randrange(VOCAB), 13]],
             "logprobs": [0, 1, 5], "prompt_logprobs": [0, 2], "n": [2, 3], "include_stop_str_in_output": [True],
             "skip_special_tokens": [False], "ignore_eos": [True],
             "structured_outputs": [StructuredOutputsParams(json_object=True), StructuredOutputsParams(json=SCHEMA)]}
    kw.update({k: rng.choice(v) for k, v in maybe.items() if rng.random() < 0.25})
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    return SamplingParams(**kw)


def same_logprobs(got, want) -> bool:
    """Same tokens and alternatives; log-probabilities as close as float32 computed in other chunk and
    batch shapes gives them; ranks equal but for ties within that noise.

    A sampled token can rank 30000th of 49152, where neighbouring logits lie a few 1e-6 apart: the
    noise of another chunk shape moves such a rank by one now and then (seen once in CI)."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        a.token_id == b.token_id and abs(a.rank - b.rank) <= 2 and [t for t, _ in a.top] == [t for t, _ in b.top]
        and math.isclose(a.logprob, b.logprob, rel_tol=1e-3, abs_tol=1e-3) for a, b in zip(got, want))


@pytest.mark.parametrize("seed", [0, 1])  # the soak (tests/test_soak.py) runs many more workloads, without the model
def test_random_requests_through_small_tiers_get_what_they_get_alone_without_caching(seed, reference,
                                                                                     embedded_model_fp32, tmp_path):
    rng = random.Random(seed)
    tokenizer = reference.tokenizer
    documents = [tokenizer.encode(topics[name])[:500] for name in rng.sample(sorted(topics), 3)]
    events: list = []
    parent_of: dict[bytes, bytes | None] = {}  # every chain hash the requests made, to its parent
    for engine_round in range(2):
        config = engine_config(rng, str(tmp_path / f"kv{rng.randrange(2)}"))  # a later engine may find a store
        with LLM(config, loaded_model=embedded_model_fp32, events=events.append) as llm:
            for _ in range(2):
                batch = [(rng.choice(documents)[:rng.choice([5, 17, 32, 100, 250, 400])]
                          + tokenizer.encode(rng.choice(QUESTIONS)), random_params(rng), rng.choice([None, "tenant"]))
                         for _ in range(rng.randint(2, 5))]
                by_salt: dict = {}
                for i, (_, _, salt) in enumerate(batch):
                    by_salt.setdefault(salt, []).append(i)
                got = {}
                for salt, indices in by_salt.items():
                    outputs = llm.generate([batch[i][0] for i in indices], [batch[i][1] for i in indices],
                                           cache_salt=salt)
                    got.update(zip(indices, outputs))
                for i, (prompt, params, salt) in enumerate(batch):
                    want = reference.generate([prompt], params)[0]
                    where = f"seed {seed}, engine {engine_round} {config}, request {i}: {params}"
                    assert len(got[i].outputs) == params.n, where
                    for g, w in zip(got[i].outputs, want.outputs):
                        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
                               (w.token_ids, w.text, w.finish_reason, w.stop_reason), where
                        assert same_logprobs(g.logprobs, w.logprobs), where
                    assert same_logprobs(got[i].prompt_logprobs, want.prompt_logprobs), where
                    for sequence in got[i].outputs:  # the blocks its prompt and answer filled
                        chain = llm.engine.kv_manager.hasher.hash(prompt + sequence.token_ids, cache_salt=salt)
                        parent_of.update(zip(chain, [None, *chain[:-1]]))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} >= {"device"}
    for event in stored:  # one run of a chain, with the parent of its first block
        assert event.parent_block_hash == parent_of[event.block_hashes[0]], event.medium
        assert all(parent_of[b] == a for a, b in zip(event.block_hashes, event.block_hashes[1:])), event.medium
