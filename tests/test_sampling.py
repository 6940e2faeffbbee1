"""Sampling parameters and the sampler (no model: synthetic logits)."""
import itertools

import pytest
import torch

from kvstrata.engine.sampling import (MAX_LOGPROBS, SamplingParams, adjust_logits, compute_logprobs, make_generator,
                                      sample)

VOCAB = 1000


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample_seeded(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return sample(logits, params, [make_generator(p, "cpu") for p in params])


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5),
    ("seed", "abc"), ("seed", 2**63), ("seed", -2**63 - 1),
    ("stop", ""), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"ok": 1}),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_tokens", -1), ("min_tokens", 17),
    ("min_tokens", 1.0), ("presence_penalty", 2.5), ("presence_penalty", float("nan")),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("repetition_penalty", float("inf")), ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]),
    ("stop_token_ids", 2), ("logit_bias", {3: 101}), ("logit_bias", {-1: 5}), ("logit_bias", {"3": 5}),
    ("logit_bias", {3: float("nan")}), ("logit_bias", [3]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} ") as info:
        SamplingParams(**{field: value})
    assert "\n" not in str(info.value)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_temperature_zero_is_argmax():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(-1))


@pytest.mark.parametrize("seed", [0, 2**63 - 1, -2**63])
def test_every_64_bit_seed_seeds_a_generator(seed):
    params = SamplingParams(seed=seed)
    assert make_generator(params, "cpu") is not None


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, 0.0])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    logits = _logits(8)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(8)]
    assert all(p.greedy for p in params)
    assert torch.equal(_sample_seeded(logits, params), logits.argmax(-1))


def test_logprobs_are_the_raw_log_softmax_of_the_sampled_and_likeliest_tokens():
    logits = _logits(3)
    params = [SamplingParams(temperature=0.7, seed=1, logprobs=2), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    token_ids = _sample_seeded(logits, params)
    with_logprobs, without, sampled_only = compute_logprobs(logits, token_ids, [p.logprobs for p in params])
    expected = logits.log_softmax(-1)  # before temperature, top-k and top-p (vLLM's raw logprobs)
    assert without is None
    assert with_logprobs.token_id == token_ids[0] and sampled_only.token_id == token_ids[2]
    assert with_logprobs.logprob == pytest.approx(expected[0, token_ids[0]].item(), abs=1e-6)
    top_ids = expected[0].topk(2).indices.tolist()
    assert [t for t, _ in with_logprobs.top] == top_ids
    assert [v for _, v in with_logprobs.top] == pytest.approx(expected[0, top_ids].tolist(), abs=1e-6)
    assert sampled_only.top == () and sampled_only.logprob == pytest.approx(expected[2].max().item(), abs=1e-6)


def test_a_tokens_rank_is_its_place_in_the_vocabulary_by_logprob():
    logits = _logits(3)
    logits[2, :] = 0.0  # every token ties: each is ranked behind all the others, as vLLM ranks ties
    order = logits.argsort(dim=-1, descending=True)
    token_ids = torch.tensor([order[0, 0], order[1, 41], 5])
    first, forty_second, tied = compute_logprobs(logits, token_ids, [0, 3, 0])
    assert (first.rank, forty_second.rank, tied.rank) == (1, 42, VOCAB)
    assert forty_second.token_id not in [t for t, _ in forty_second.top]


def test_rows_that_ask_for_no_logprobs_get_none():
    logits = _logits(2)
    params = [SamplingParams(temperature=0.0)] * 2
    assert compute_logprobs(logits, sample(logits, params, [None, None]), [p.logprobs for p in params]) == [None, None]


def test_seeded_sampling_is_reproducible():
    logits = _logits(1)
    params = [SamplingParams(temperature=1.0, seed=7)]
    generator = make_generator(params[0], "cpu")
    first = [sample(logits, params, [generator]).item() for _ in range(20)]
    generator = make_generator(params[0], "cpu")
    again = [sample(logits, params, [generator]).item() for _ in range(20)]
    assert first == again
    assert len(set(first)) > 1, "successive draws of one request must differ (the stream advances)"


def test_seeded_request_is_independent_of_its_batch_companions():
    logits = _logits(4)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123)
    alone = _sample_seeded(logits[2:3], [seeded])
    companions = [SamplingParams(temperature=1.3, seed=1), SamplingParams(temperature=0.0),
                  seeded, SamplingParams(temperature=0.5, top_k=3)]
    batched = _sample_seeded(logits, companions)
    reordered = _sample_seeded(logits.flip(0), companions[::-1])
    assert batched[2] == alone[0] == reordered[1]


def test_different_seeds_give_different_samples():
    logits = torch.zeros(1, VOCAB)  # uniform: two seeds agreeing 8 times in a row is (1/1000)^8
    a = [_sample_seeded(logits, [SamplingParams(seed=1 + i)]).item() for i in range(8)]
    b = [_sample_seeded(logits, [SamplingParams(seed=100 + i)]).item() for i in range(8)]
    assert a != b


def test_top_k_one_is_greedy():
    logits = _logits(8)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    assert torch.equal(_sample_seeded(logits, params), logits.argmax(-1))


def test_tiny_top_p_is_greedy():
    logits = _logits(8)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(8)]
    assert torch.equal(_sample_seeded(logits, params), logits.argmax(-1))


def test_top_k_only_ever_samples_the_k_most_likely():
    logits = _logits(1)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5, seed=3)]
    generator = make_generator(params[0], "cpu")
    drawn = {sample(logits, params, [generator]).item() for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_only_ever_samples_inside_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(top_p=0.7, seed=5)]
    generator = make_generator(params[0], "cpu")
    drawn = {sample(logits, params, [generator]).item() for _ in range(200)}
    assert drawn == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = [SamplingParams(seed=11)]
    generator = make_generator(params[0], "cpu")
    counts = torch.bincount(torch.stack([sample(logits, params, [generator])[0] for _ in range(3000)]),
                            minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)



def test_unseeded_rows_of_one_batch_draw_independently_from_the_distribution():
    # the rows without a seed share one draw of noise: each row must still get its own
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(3000, 3)
    params = [SamplingParams()] * 3000
    drawn = sample(logits, params, [None] * 3000)
    assert torch.allclose(torch.bincount(drawn, minlength=3) / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)
    # beside seeded rows, which keep their own streams
    seeded = SamplingParams(seed=11)
    mixed = sample(logits[:4], [params[0], seeded, params[0], seeded], [None, make_generator(seeded, "cpu"), None,
                                                                        make_generator(seeded, "cpu")])
    alone = sample(logits[:1], [seeded], [make_generator(seeded, "cpu")])
    assert mixed[1] == mixed[3] == alone[0]

# -- min_tokens, logit_bias, penalties (`adjust_logits`), min_p ------------------------------------------------

EOS = [7]


def adjusted(params: SamplingParams, prompt=(), output=(), logits=None) -> torch.Tensor:
    logits = torch.zeros(1, 10) if logits is None else logits
    return adjust_logits(logits, [params], [list(prompt)], [list(output)], EOS)[0]


def test_rows_that_ask_for_nothing_keep_their_logits():
    logits = _logits(2)
    params = [SamplingParams(), SamplingParams(min_tokens=0, presence_penalty=0.0, repetition_penalty=1.0)]
    assert adjust_logits(logits, params, [[1, 2], [3]], [[4], []], EOS) is logits


def test_min_tokens_keeps_the_end_of_sequence_and_stop_tokens_out_until_enough_are_out():
    params = SamplingParams(min_tokens=3, stop_token_ids=[2, 4])
    row = adjusted(params, output=[1, 1])
    assert row[[2, 4, 7]].tolist() == [float("-inf")] * 3 and row[[0, 1, 3]].tolist() == [0.0] * 3
    assert torch.equal(adjusted(params, output=[1, 1, 1]), torch.zeros(10))  # the third token is out: anything goes
    ignoring = adjusted(SamplingParams(min_tokens=3, ignore_eos=True), output=[])
    assert ignoring[7] == 0.0  # an end of sequence that ends nothing is not held back
    logits = torch.zeros(1, 10)
    logits[0, 7] = 50.0  # the model wants to stop: greedy takes the next best instead
    assert sample(adjust_logits(logits, [params], [[]], [[]], EOS), [SamplingParams(temperature=0.0)], [None]) != 7


def test_logit_bias_adds_to_the_named_tokens_only():
    row = adjusted(SamplingParams(logit_bias={3: 100, 5: -2.5}))
    assert row.tolist() == [0, 0, 0, 100, 0, -2.5, 0, 0, 0, 0]


def test_presence_and_frequency_penalties_count_the_generated_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = adjusted(params, prompt=[1, 1, 9], output=[2, 2, 2, 3])
    expected = torch.zeros(10)
    expected[2] = -(0.5 + 3 * 0.25)
    expected[3] = -(0.5 + 0.25)
    assert torch.equal(row, expected)  # the prompt's tokens 1 and 9 are not penalised
    assert adjusted(SamplingParams(presence_penalty=-1.0), output=[4])[4] == 1.0  # a negative penalty favours


def test_repetition_penalty_shrinks_the_logits_of_tokens_in_the_prompt_or_the_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    row = adjusted(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3], logits=logits)
    assert row.tolist() == [1.0, -4.0, 2.0, -4.0, 2.0]  # positive ones divided, negative ones multiplied


@pytest.mark.parametrize("penalty", [1e-39, 1e-300])  # float32's subnormals, and a value float32 holds as 0
def test_a_repetition_penalty_near_zero_favours_the_seen_tokens_and_samples_from_them_alone(penalty):
    logits = torch.tensor([[2.0, 1.0, 3.0, -2.0, 0.5]])
    row = adjusted(SamplingParams(repetition_penalty=penalty), prompt=[0, 1], logits=logits.clone())
    assert torch.isfinite(row).all()
    for seed, temperature in itertools.product(range(10), (1.0, 0.5, 2e-5)):
        params = SamplingParams(temperature=temperature, seed=seed, repetition_penalty=penalty)
        token = _sample_seeded(adjust_logits(logits.clone(), [params], [[0, 1]], [[]], EOS), [params])
        assert token.item() in (0, 1)  # the seen tokens with positive logits, pushed to the top


def _penalised_by_hand(row: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The penalties of one row, token by token, as the README states them."""
    out = []
    for token, value in enumerate(row):
        if token in prompt or token in output:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        count = output.count(token)
        out.append(value - params.frequency_penalty * count - params.presence_penalty * (count > 0))
    return out


def test_penalties_of_a_batch_are_each_rows_own_whatever_the_other_rows_ask():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 12, generator=generator)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, frequency_penalty=1.0, presence_penalty=0.2),
              SamplingParams(presence_penalty=1.0)]
    prompts = [[1, 2, 2], [3], [4, 5], [0, 11, 6], []]
    outputs = [[7, 7], [8, 8, 8, 1], [9], [], [11, 2, 11]]
    batch = adjust_logits(logits, params, prompts, outputs, EOS)
    for i in range(5):
        alone = adjust_logits(logits[i:i + 1], params[i:i + 1], prompts[i:i + 1], outputs[i:i + 1], EOS)[0]
        assert torch.equal(batch[i], alone)
        assert batch[i].tolist() == pytest.approx(_penalised_by_hand(logits[i].tolist(), params[i], prompts[i],
                                                                     outputs[i]), abs=1e-6)


def test_adjusting_leaves_the_logits_the_log_probabilities_come_from():
    logits = _logits(1)
    before = logits.clone()
    adjust_logits(logits, [SamplingParams(logit_bias={0: 100}, repetition_penalty=1.5)], [[1]], [[2]], EOS)
    assert torch.equal(logits, before)


def test_min_p_only_ever_samples_tokens_at_least_that_share_of_the_most_likely():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps those >= 0.125
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(min_p=0.25, seed=5)]
    generator = make_generator(params[0], "cpu")
    drawn = {sample(logits, params, [generator]).item() for _ in range(300)}
    assert drawn == {0, 1, 2}


def test_a_prompt_given_as_a_tensor_is_penalised_as_the_same_token_list():
    logits, params = _logits(2), [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2)] * 2
    prompts, outputs = [[1, 5, 5, 9], [2, 3]], [[5, 7], []]
    as_lists = adjust_logits(logits, params, prompts, outputs, EOS)
    as_tensors = adjust_logits(logits, params, [torch.tensor(p) for p in prompts], outputs, EOS)
    assert torch.equal(as_lists, as_tensors) and not torch.equal(as_lists, logits)


@pytest.mark.parametrize("n", [0, 129, 2.0, True, None])
def test_n_is_an_integer_from_1_to_128(n):
    with pytest.raises(ValueError, match="^n must be an integer from 1 to 128"):
        SamplingParams(n=n)


def test_each_sequence_of_a_prompt_samples_alone_with_the_seed_moved_on_by_its_index():
    params = SamplingParams(n=3, seed=5, temperature=0.7)
    sequences = [params.for_choice(i) for i in range(3)]
    assert [p.seed for p in sequences] == [5, 6, 7]
    assert {p.n for p in sequences} == {1} and {p.temperature for p in sequences} == {0.7}
    assert SamplingParams(n=2, seed=2**63 - 1).for_choice(1).seed == -2**63  # wraps within 64 bits
    assert SamplingParams(n=2).for_choice(1).seed is None  # unseeded sequences stay unseeded
