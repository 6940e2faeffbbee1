"""Steps of few tokens (decodes, questions, questions beside decodes) padded to the fixed sizes CUDA graphs are
recorded at (engine/cuda_graphs.py), run eagerly on the CPU through the same code (recording and replay themselves
need a GPU: tests/test_engine_cuda.py): the padded step gives the unpadded step's logits, a padding token never
writes K/V, steps that do not fit run as they are, and an engine answering several prompts at once answers as
without graphs."""
from __future__ import annotations

import pytest
import torch
from test_model_runner import BLOCK_SIZE, Chunk, blocks_for, build_step

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.config import ConfigError
from kvstrata.engine.cuda_graphs import CAPTURE_SIZES, StepGraphs
from kvstrata.engine.decoder import StepInput
from kvstrata.engine.model_runner import ModelRunner
from kvstrata.kernels.backends import get_ops
from kvstrata.tiers.base import BlockLayout

pytestmark = pytest.mark.slow
NUM_BLOCKS = 64
MAX_BLOCKS = 12


def runner(loaded, graphs: bool) -> ModelRunner:
    """A runner over random K/V; batch-invariant, so that a row's bits cannot depend on the padding beside it
    (the CPU's GEMM otherwise rounds a product of 4 rows otherwise than one of 3)."""
    cfg = loaded.model_config
    layout = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv_cache = layout.allocate(NUM_BLOCKS, "cpu").normal_(generator=torch.Generator().manual_seed(0))
    r = ModelRunner(loaded, kv_cache, get_ops("torch", batch_invariant=True))
    if graphs:
        r.enable_cuda_graphs(max_num_seqs=8, max_blocks=MAX_BLOCKS, record=False)
    return r


def decode_step(contexts: list[int], first_block: int = 0):
    """One new token per sequence, after `contexts[i]` cached positions, each sequence in blocks of its own."""
    chunks, block = [], first_block
    for i, context in enumerate(contexts):
        table = blocks_for(context + 1, block)
        block += len(table)
        chunks.append(Chunk([100 + i], context, table))
    return build_step(chunks)


@pytest.mark.parametrize("contexts", [[40], [17, 70, 3], [5, 33, 64, 2, 90]])  # padded to 1, 4 and 8
def test_a_padded_decode_step_gives_the_unpadded_steps_logits_and_cache(embedded_model_fp32, contexts):
    plain, padded = runner(embedded_model_fp32, False), runner(embedded_model_fp32, True)
    step = decode_step(contexts)
    expected = plain.execute(step)
    logits = padded.execute(step)
    size = min(s for s in CAPTURE_SIZES if s >= len(contexts))
    assert padded.recorded_graph_sizes == [(size, size)]
    assert torch.equal(logits, expected)
    assert torch.equal(padded.kv_cache, plain.kv_cache)


def test_padding_rows_left_by_a_larger_step_write_no_kv(embedded_model_fp32):
    padded = runner(embedded_model_fp32, True)
    first = decode_step([10, 20, 30, 40, 50, 60, 70])  # 7 sequences: size 8
    padded.execute(first)
    stale_slots = torch.as_tensor(first.slot_mapping[5:])  # the rows the next, smaller step leaves as padding
    blocks, offsets = stale_slots // BLOCK_SIZE, stale_slots % BLOCK_SIZE
    padded.kv_cache[blocks, :, :, offsets] = 7.0  # as if those blocks now held another sequence's K/V
    padded.execute(decode_step([10, 20, 30, 40, 50]))  # 5 sequences: the same size 8
    assert padded.recorded_graph_sizes == [(8, 8)]
    assert bool((padded.kv_cache[blocks, :, :, offsets] == 7.0).all())


def question_step(question_tokens: int, context: int, decode_contexts: list[int], want_logits: bool = True):
    """A question of `question_tokens` after `context` cached positions, beside sequences decoding one token each
    after theirs (the step that admits a hit beside a decode stream)."""
    table = blocks_for(context + question_tokens)
    chunks = [Chunk(list(range(200, 200 + question_tokens)), context, table)]
    block = len(table)
    for i, decode_context in enumerate(decode_contexts):
        decode_table = blocks_for(decode_context + 1, block)
        block += len(decode_table)
        chunks.append(Chunk([100 + i], decode_context, decode_table))
    return build_step(chunks, want_logits=want_logits)


@pytest.mark.parametrize("question, context, decodes, size", [
    (16, 40, [], (32, 2)),            # a question alone: one padding sequence takes 16 padding tokens
    (11, 0, [30, 7], (16, 4)),         # a short prompt beside two decodes: a padding sequence of 1, one of 2
    (20, 70, [5, 33, 64, 2], (32, 8)),  # three padding sequences
])
def test_a_padded_question_gives_the_unpadded_steps_logits_and_cache(embedded_model_fp32, question, context,
                                                                      decodes, size):
    plain, padded = runner(embedded_model_fp32, False), runner(embedded_model_fp32, True)
    step = question_step(question, context, decodes)
    expected = plain.execute(step)
    logits = padded.execute(step)
    assert padded.recorded_graph_sizes == [size]
    assert logits.shape == expected.shape == (1 + len(decodes), embedded_model_fp32.model_config.vocab_size)
    assert torch.equal(logits, expected)
    assert torch.equal(padded.kv_cache, plain.kv_cache)


def test_a_prefill_chunk_that_samples_nothing_is_padded_too(embedded_model_fp32):
    plain, padded = runner(embedded_model_fp32, False), runner(embedded_model_fp32, True)
    step = question_step(37, 0, [], want_logits=False)
    assert padded.execute(step).shape == plain.execute(step).shape == (0, embedded_model_fp32.model_config.vocab_size)
    assert padded.recorded_graph_sizes == [(64, 2)]
    assert torch.equal(padded.kv_cache, plain.kv_cache)


def test_padding_tokens_left_by_a_larger_question_write_no_kv(embedded_model_fp32):
    padded = runner(embedded_model_fp32, True)
    first = question_step(40, 16, [10, 20])  # 42 tokens, 3 sequences: size (64, 4)
    padded.execute(first)
    stale_slots = torch.as_tensor(first.slot_mapping[31:])  # rows the next, smaller question leaves as padding
    blocks, offsets = stale_slots // BLOCK_SIZE, stale_slots % BLOCK_SIZE
    padded.kv_cache[blocks, :, :, offsets] = 7.0  # as if those blocks now held another sequence's K/V
    padded.execute(question_step(30, 16, [10]))  # 31 tokens, 2 sequences: the same size
    assert padded.recorded_graph_sizes == [(64, 4)]
    assert bool((padded.kv_cache[blocks, :, :, offsets] == 7.0).all())


def test_steps_a_size_does_not_hold_run_as_they_are(embedded_model_fp32):
    graphs = StepGraphs(lambda step: None, max_num_seqs=4, max_blocks=MAX_BLOCKS, device=torch.device("cpu"),
                        record=False, max_tokens=64)
    assert graphs.seq_sizes == [1, 2, 4] and graphs.token_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert graphs.fits(decode_step([10, 20, 30, 40]))
    assert not graphs.fits(decode_step([10, 20, 30, 40, 50]))  # more sequences than the largest size
    assert not graphs.fits(decode_step([MAX_BLOCKS * BLOCK_SIZE]))  # a block table wider than the sizes'
    assert graphs.fits(build_step([Chunk([1, 2, 3], 0, [0])]))  # a short prefill
    assert graphs.fits(build_step([Chunk([1], 5, [0])], want_logits=False))  # no logits wanted
    assert graphs.fits(question_step(60, 0, []))  # 60 tokens and a padding sequence's 4
    assert not graphs.fits(question_step(64, 0, []))  # no room left for a padding sequence's token
    assert not graphs.fits(question_step(5, 0, [1, 2, 3]))  # 4 sequences and no room for a padding one
    prompt_rows = build_step([Chunk([1, 2, 3], 0, [0])])
    prompt_rows.logits_indices = [0, 1, 2]  # prompt log-probabilities: more logits rows than sequences
    assert not graphs.fits(prompt_rows)


def test_an_engine_answering_prompts_at_once_answers_as_without_padding(embedded_model_fp32):
    from pydoc_data.topics import topics

    prompts = [topics["try"][:300], topics["if"][:150] + " Explain.", "Say hello.", topics["while"][:420]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 6)]
    config = {"model": {"dtype": "float32", "device": "cpu"}, "cache": {"tiers": {"device": {"size": 128}}}}
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        llm.engine.runner.enable_cuda_graphs(max_num_seqs=8, max_blocks=32, record=False)
        outs = llm.generate(prompts, params)  # prefilled, then four sequences decode, then three, two, one
        sizes = llm.engine.runner.recorded_graph_sizes
        assert {(1, 1), (2, 2), (4, 4)} <= set(sizes)  # the decodes
        assert any(tokens > seqs for tokens, seqs in sizes)  # the prompts, up to 512 tokens a step
    assert [o.token_ids for o in outs] == expected


def test_cuda_graphs_on_a_cpu_device_are_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"device": "cpu", "cuda_graphs": True}})
    assert info.value.key == "model.cuda_graphs" and "need a CUDA device" in str(info.value)
    assert load_config({"model": {"device": "auto", "cuda_graphs": True}}).model.cuda_graphs  # ignored without CUDA


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_cuda_graphs_with_a_rope_that_follows_the_sequence_length_are_refused_in_one_line(tmp_path, rope_key):
    import json

    from kvstrata.engine.model_spec import PRESETS

    config = {**PRESETS["llama-3-8b"], rope_key: {"rope_type": "dynamic", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = {"name": str(tmp_path), "load_format": "dummy", "device": "auto"}
    with pytest.raises(ConfigError) as info:
        load_config({"model": {**model, "cuda_graphs": True}})
    assert info.value.key == "model.cuda_graphs" and "'dynamic'" in str(info.value) and "\n" not in str(info.value)
    assert not load_config({"model": model}).model.cuda_graphs  # the model itself runs, without graphs


def test_questions_on_a_cached_document_answered_at_once_answer_as_without_padding(embedded_model_fp32):
    from pydoc_data.topics import topics

    document = topics["try"][:3000]
    questions = ["What is this section about?", "Name one keyword it explains.", "What does finally do?"]
    chats = [[{"role": "user", "content": f"{document}\n\nQuestion: {q}"}] for q in questions]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    config = {"model": {"dtype": "float32", "device": "cpu"}, "cache": {"tiers": {"device": {"size": 256}}}}
    answers, sizes = {}, []
    for graphs in (False, True):
        with LLM(config, loaded_model=embedded_model_fp32) as llm:
            if graphs:
                llm.engine.runner.enable_cuda_graphs(max_num_seqs=8, max_blocks=64, record=False)
            llm.chat(chats[0], greedy)  # the document: more tokens than any size, run eagerly, then cached
            outs = llm.chat(chats, greedy)  # the three questions in one step, over the cached document
            assert all(o.cached_tokens_by_tier["device"] > 0 for o in outs)
            answers[graphs] = [o.token_ids for o in outs]
            sizes = llm.engine.runner.recorded_graph_sizes
    assert (4, 4) in sizes and any(tokens > seqs == 4 for tokens, seqs in sizes)
    assert answers[True] == answers[False]


def test_the_sizes_recorded_at_start_hold_every_step_of_few_tokens(embedded_model_fp32):
    padded = runner(embedded_model_fp32, True)
    recorded = padded.record_all_graphs()
    tokens = (4, 8, 16, 32, 64, 128, 256, 512)
    assert recorded == [(1, 1), (2, 2), (4, 4), (8, 8)] + [(t, s) for s in (2, 4, 8) for t in tokens if t > s]
    assert padded.recorded_graph_sizes == sorted(recorded)
    padded.execute(question_step(16, 40, []))  # a question alone, then three sequences decoding
    padded.execute(decode_step([17, 70, 3]))
    padded.execute(question_step(11, 0, [30, 7]))  # a short prompt beside two decodes
    padded.execute(question_step(20, 70, [5, 33, 64, 2]))  # a question beside four
    assert padded.recorded_graph_sizes == sorted(recorded)  # nothing recorded on a step's path


def one_sequence_step(num_tokens: int) -> StepInput:
    """A step of one sequence computing `num_tokens` after nothing cached, its last token's logits wanted."""
    return StepInput(input_ids=[0] * num_tokens, positions=list(range(num_tokens)), slot_mapping=[-1] * num_tokens,
                     block_tables=[[0]], query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                     logits_indices=[num_tokens - 1])


@pytest.mark.parametrize("max_num_seqs,record,expected", [(64, True, 511), (64, False, 0), (1, True, 0)])
def test_the_step_cost_is_told_the_longest_one_sequence_step_a_recorded_size_holds(max_num_seqs, record, expected):
    """The step cost prices steps of one sequence up to `replay_tokens` at a replayed graph's fixed cost: exactly
    the steps a size holds, and none where nothing is recorded (steps padded on a CPU run eagerly)."""
    graphs = StepGraphs(lambda step: None, max_num_seqs, MAX_BLOCKS, torch.device("cpu"), record)
    assert graphs.replay_tokens == expected
    if expected:
        assert graphs.fits(one_sequence_step(expected)) and not graphs.fits(one_sequence_step(expected + 1))
