"""A request's output snapshots (`RequestOutput.from_request`, one at every token while it runs): what each shows."""
from kvstrata.engine.llm import RequestOutput
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import SamplingParams, TokenLogprobs


def entry(token_id: int, logprob: float) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, ((token_id, logprob), (0, logprob - 1.0), (1, logprob - 2.0)), 1)


def test_each_snapshot_shows_the_logprobs_so_far_and_their_sum():
    request = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=8, logprobs=1))
    sums = []
    for k, logprob in enumerate([-0.5, -1.25, -0.125]):
        request.output_token_ids.append(10 + k)
        request.append_logprobs(entry(10 + k, logprob))
        output = RequestOutput.from_request(request)
        assert [e.token_id for e in output.logprobs] == request.output_token_ids
        sums.append(output.outputs[0].cumulative_logprob)
    assert sums == [-0.5, -1.75, -1.875]


def test_every_snapshot_shows_the_prompt_logprobs_computed_so_far_with_the_alternatives_asked_for():
    request = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=8, prompt_logprobs=1))
    request.prompt_logprobs += [entry(6, -1.0), entry(7, -2.0)]  # two of the prompt's three
    partial = RequestOutput.from_request(request).prompt_logprobs
    assert [e.token_id for e in partial] == [6, 7] and all(len(e.top) == 1 for e in partial)
    request.prompt_logprobs.append(entry(8, -3.0))
    first, later = (RequestOutput.from_request(request).prompt_logprobs for _ in range(2))
    assert [e.token_id for e in first] == [6, 7, 8] and all(len(e.top) == 1 for e in first) and later == first
    assert all(len(e.top) == 3 for e in request.prompt_logprobs)  # the request keeps every alternative
