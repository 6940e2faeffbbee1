"""Scheduling by uncached work, without a model and with a fake clock: short work is admitted ahead
of long work, aging bounds every wait, a long prefill gets at most its share of a step while short
work waits (and the whole step otherwise), and the step is capped by its target time."""
from __future__ import annotations

import random

import pytest
from test_admission import fake_step, new_request
from test_hierarchy import BS, computed_blocks, doc, make_stack, run_request

from kvstrata.engine.costs import MIN_STEP_TOKENS, WINDOW, ReadCost, StepCost, attention_pairs
from kvstrata.engine.request import RequestStatus
from kvstrata.engine.scheduler import AGING, ARRIVALS_MEMORY_S, LONG_STEP_TARGETS, MIN_AGE_S, Scheduler


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(policy: str, budget: int = 64, device_blocks: int = 256, share: float = 0.25,
                   step_target: float = 100.0, seconds_per_token: float = 0.01):
    kv = make_stack(device_blocks=device_blocks)
    clock = FakeClock()
    scheduler = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=16, policy=policy,
                          step_target=step_target, long_prefill_share=share, clock=clock)
    kv.step_cost = StepCost(per_token_s=seconds_per_token)
    return kv, scheduler, clock


def add(scheduler: Scheduler, clock: FakeClock, tokens: list[int], max_tokens: int = 1):
    request = new_request(tokens, max_tokens)
    request.arrival_time = clock.now
    scheduler.add_request(request)
    return request


def step(kv, scheduler: Scheduler, clock: FakeClock, arrive_mid_step: list[int] | None = None) -> dict:
    """One fake step, whose compute takes a second; finishes requests that reached max_tokens; returns
    {request: tokens scheduled}. `arrive_mid_step`: a prompt that arrives while the step computes
    (and is added after it, as the engine adds what came during a step)."""
    out_tokens = {}
    original_schedule, original_update = scheduler.schedule, scheduler.update_after_step

    def recording_schedule():
        out = original_schedule()
        out_tokens.update({s.request: s.num_new_tokens for s in out.scheduled})
        return out

    def timed_update(out):
        clock.now += 1.0
        original_update(out)

    scheduler.schedule, scheduler.update_after_step = recording_schedule, timed_update
    try:
        for req in fake_step(kv, scheduler):
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    finally:
        scheduler.schedule, scheduler.update_after_step = original_schedule, original_update
    if arrive_mid_step is not None:
        request = new_request(arrive_mid_step)
        request.arrival_time = clock.now - 0.5
        scheduler.add_request(request)
    return out_tokens


def cached_question(kv, seed: int, doc_blocks: int = 10, question_tokens: int = 5) -> list[int]:
    """A prompt whose document (its first `doc_blocks` blocks) is cached on the device already."""
    document = doc(seed, doc_blocks * BS)
    run_request(kv, document + [1])
    return document + doc(seed + 1000, question_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_a_mostly_cached_question_is_admitted_ahead_of_a_long_uncached_document(policy):
    kv, scheduler, clock = make_scheduler(policy)
    question = cached_question(kv, 1)
    long_doc = add(scheduler, clock, doc(2, 320))          # arrives first: 320 tokens to compute
    short = add(scheduler, clock, question)                # 5 tokens to compute
    scheduled = step(kv, scheduler, clock)
    if policy == "uncached_first":
        assert short in scheduled and scheduled[short] == 5
        assert short.status == RequestStatus.FINISHED_LENGTH  # its first token came in the first step
    else:
        assert short not in scheduled and scheduled[long_doc] == 64  # first come, whole budget


def test_aging_bounds_the_wait_of_a_long_request_behind_a_stream_of_short_ones():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=32, share=1.0)
    long_request = add(scheduler, clock, doc(3, 128))  # cost 1.28 s at 10 ms a token
    bound = max(AGING * 128 * 0.01, MIN_AGE_S)
    admitted_at = None
    for i in range(20):
        for k in range(4):  # four new 8-token requests a step: they alone fill the 32-token budget
            add(scheduler, clock, doc(100 + 10 * i + k, 8))
        now = clock.now
        scheduled = step(kv, scheduler, clock)
        if long_request in scheduled:
            admitted_at = now
            break
    assert admitted_at is not None, "the long request was never admitted"
    assert admitted_at >= bound - 1.0  # not overdue before its bound: short work went first
    assert admitted_at <= bound + 1.0  # admitted at the first step once overdue
    assert admitted_at > 0


def test_a_long_prefill_gets_its_share_while_short_work_waits_and_the_whole_budget_otherwise():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=64, share=0.25)
    long_request = add(scheduler, clock, doc(4, 480))
    assert step(kv, scheduler, clock)[long_request] == 64  # nothing else waits: the whole budget
    question = cached_question(kv, 5)
    short = add(scheduler, clock, question)
    scheduled = step(kv, scheduler, clock)
    assert scheduled[long_request] == 16  # a quarter of the step
    assert scheduled[short] == 5          # and the short request is not kept waiting
    assert step(kv, scheduler, clock)[long_request] == 64  # short work done: the whole budget again


def test_a_long_prefills_share_is_of_the_step_target_even_where_step_overheads_raise_the_cap():
    """A step's fixed cost of 0.5 s raises the cap to 450 tokens (overheads under a tenth of a step),
    but while a short request waits the long prefill keeps half of the 1 s target's compute, 25 tokens,
    not half of 450: the short request's step stays near its target."""
    kv, scheduler, clock = make_scheduler("uncached_first", budget=2048, step_target=1.0, share=0.5)
    kv.step_cost = StepCost(per_token_s=0.01, overhead_s=0.5)
    long_request = add(scheduler, clock, doc(24, 2000))
    step(kv, scheduler, clock)
    short = add(scheduler, clock, cached_question(kv, 25))
    scheduled = step(kv, scheduler, clock)
    assert scheduled == {short: 5, long_request: 25}


def test_a_question_does_not_wait_for_the_end_of_a_document_that_would_overrun_its_step():
    """A document's last 100 tokens fit under the cap that step overheads raise (450 tokens) but not in
    the 1 s target (50): while a question waits, the document keeps its share (25) and finishes after."""
    kv, scheduler, clock = make_scheduler("uncached_first", budget=2048, step_target=1.0, share=0.5,
                                          device_blocks=1024)
    kv.step_cost = StepCost(per_token_s=0.01, overhead_s=0.5)
    document = add(scheduler, clock, doc(26, 1600))
    step(kv, scheduler, clock)
    step(kv, scheduler, clock)  # two long steps of 750 tokens: 100 left
    short = add(scheduler, clock, cached_question(kv, 27))
    assert step(kv, scheduler, clock) == {short: 5, document: 25}
    assert step(kv, scheduler, clock) == {document: 75}  # the question answered, the document finishes


def test_a_short_request_waiting_for_a_sequence_slot_does_not_hold_a_long_prefill_back():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=64, share=0.25)
    long_request = add(scheduler, clock, doc(28, 480))
    step(kv, scheduler, clock)
    scheduler.max_num_seqs = 1  # the long prefill holds the only slot
    short = add(scheduler, clock, cached_question(kv, 29))
    assert step(kv, scheduler, clock) == {long_request: 64}  # not a quarter: the question cannot come in anyway
    assert short.status == RequestStatus.WAITING


def test_several_prefills_run_at_once():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=64, share=0.25)
    first = add(scheduler, clock, doc(6, 480))
    step(kv, scheduler, clock)
    second = add(scheduler, clock, doc(7, 48))  # fits in one step, so it is short
    scheduled = step(kv, scheduler, clock)
    assert scheduled[first] == 16 and scheduled[second] == 48
    assert first.num_computed_tokens < first.num_tokens  # still mid-prefill alongside the other


def test_the_step_is_capped_by_its_target_time_at_the_measured_speed_while_short_work_waits():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=2048, step_target=0.5, share=1.0,
                                          seconds_per_token=1 / 128)
    question = cached_question(kv, 12)
    first = add(scheduler, clock, doc(8, 960))
    add(scheduler, clock, doc(10, 960))
    add(scheduler, clock, question)
    assert sum(step(kv, scheduler, clock).values()) == 64  # 0.5 s at 128 tokens a second
    add(scheduler, clock, cached_question(kv, 13))
    kv.step_cost = StepCost(per_token_s=1.0)  # a very slow engine: never below the floor
    assert sum(step(kv, scheduler, clock).values()) == MIN_STEP_TOKENS
    assert first.num_computed_tokens > 0


@pytest.mark.parametrize("others", ["none", "long", "decode"])
def test_with_no_first_token_at_stake_a_step_lasts_at_most_long_step_targets(others):
    """A lone document, documents side by side, or a document beside a streaming answer: steps far
    longer than the target (little lost to step overheads), yet bounded, so that a decode's next
    token waits at most LONG_STEP_TARGETS step targets (requests here are added between steps)."""
    kv, scheduler, clock = make_scheduler("uncached_first", budget=2048, step_target=0.5,
                                          seconds_per_token=1 / 128)
    if others == "decode":
        decoding = add(scheduler, clock, cached_question(kv, 18), max_tokens=5)
        step(kv, scheduler, clock)  # its prefill and first token
    first = add(scheduler, clock, doc(8, 960))
    if others == "long":
        add(scheduler, clock, doc(10, 960))
    scheduled = step(kv, scheduler, clock)
    long_step = LONG_STEP_TARGETS * 64  # 0.5 s at 128 tokens a second is 64 tokens
    assert scheduled[first] + (scheduled[decoding] if others == "decode" else 0) == long_step
    assert sum(scheduled.values()) == long_step  # not the 64 of one target, nor the 2048 of the budget


def test_once_requests_arrive_while_steps_run_every_step_keeps_to_the_target_for_a_while():
    """Online serving: a request that arrived mid-step waited for that step, so steps stop running
    long (a question arriving next would wait for eight targets); after ARRIVALS_MEMORY_S with none,
    they run long again. Requests added between steps (a batch, or the test above) leave them long."""
    kv, scheduler, clock = make_scheduler("uncached_first", budget=2048, step_target=0.5,
                                          seconds_per_token=1 / 128, device_blocks=1024)
    first = add(scheduler, clock, doc(30, 2400))
    long_step, one_target = LONG_STEP_TARGETS * 64, 64  # 0.5 s at 128 tokens a second is 64 tokens
    assert step(kv, scheduler, clock) == {first: long_step}
    assert step(kv, scheduler, clock, arrive_mid_step=doc(31, 400)) == {first: long_step}
    arrived = clock.now - 0.5
    # the second document arrived during that step: from now on steps keep to the target ...
    assert sum(step(kv, scheduler, clock).values()) == one_target
    while clock.now - arrived < ARRIVALS_MEMORY_S:
        assert sum(step(kv, scheduler, clock).values()) == one_target
    # ... until none has for ARRIVALS_MEMORY_S; a request added between steps waited for none
    add(scheduler, clock, doc(32, 320))
    assert sum(step(kv, scheduler, clock).values()) == long_step


def test_long_prefills_share_one_bounded_chunk_and_the_one_with_least_work_left_goes_first():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=64, share=0.25)
    long_a = add(scheduler, clock, doc(14, 480))
    assert step(kv, scheduler, clock) == {long_a: 64}  # alone: the whole budget
    long_b = add(scheduler, clock, doc(15, 200))
    short = add(scheduler, clock, cached_question(kv, 16))
    scheduled = step(kv, scheduler, clock)
    assert scheduled[short] == 5  # short work is not kept waiting ...
    assert scheduled[long_a] + scheduled.get(long_b, 0) <= 16 + 1  # ... and the long ones share a quarter
    assert long_b.status == RequestStatus.RUNNING  # several prefills in flight at once
    scheduled = step(kv, scheduler, clock)  # nothing short left: the one with least work left takes it all
    assert scheduled == {long_b: 64}
    short = add(scheduler, clock, cached_question(kv, 17))
    scheduled = step(kv, scheduler, clock)
    assert scheduled[short] == 5 and scheduled[long_b] == 16 and long_a not in scheduled


def test_fcfs_keeps_the_whole_budget_for_the_request_that_came_first():
    kv, scheduler, clock = make_scheduler("fcfs", budget=2048, step_target=0.01)
    long_request = add(scheduler, clock, doc(9, 60 * BS))
    assert step(kv, scheduler, clock)[long_request] == 60 * BS  # no step cap, no share


def test_decodes_alone_are_scheduled_without_asking_the_step_cost_and_an_arrival_asks_it_again(monkeypatch):
    kv, scheduler, clock = make_scheduler("uncached_first", step_target=0.01)
    requests = [add(scheduler, clock, doc(40 + i, 3 * BS), max_tokens=20) for i in range(4)]
    while not all(r.output_token_ids for r in requests):  # their prompts
        step(kv, scheduler, clock)
    fit = kv.step_cost.fit
    solves = []
    monkeypatch.setattr(fit, "_solve", lambda real=fit._solve: (solves.append(1), real())[1])
    for _ in range(10):
        kv.step_cost.observe(4, 0.001)  # the engine reports each step's time: the fit is out of date
        assert step(kv, scheduler, clock) == {r: 1 for r in requests}  # every sequence decodes at every step
    assert not solves  # nothing it could answer would change such a step: no refit after every decode
    question = add(scheduler, clock, doc(50, 2 * BS))
    assert step(kv, scheduler, clock)[question] == 2 * BS
    assert solves  # a request to admit is priced, and the step capped, by the measured cost


def test_step_cost_learns_overhead_per_token_and_attention_costs_from_measured_steps():
    cost = StepCost(per_token_s=0.1)  # a prior 100x off: measurements replace it
    overhead, per_token, per_pair, per_read = 1 / 64, 1 / 1024, 1 / 2 ** 20, 1 / 2 ** 16

    def seconds(tokens: int, context: int) -> float:
        return overhead + per_token * tokens + per_pair * attention_pairs(tokens, context) + per_read * (context + tokens)

    def observe(tokens: int, context: int) -> None:
        cost.observe(tokens, seconds(tokens, context), attention_pairs(tokens, context), context + tokens)

    for tokens, context in [(1, 100), (1, 900), (2, 300), (64, 0), (256, 0), (256, 512), (128, 1024), (16, 2048)]:
        observe(tokens, context)
    assert cost.overhead_s == pytest.approx(overhead, rel=1e-2)
    assert cost.per_token_s == pytest.approx(per_token, rel=1e-2)
    assert cost.per_pair_s == pytest.approx(per_pair, rel=1e-2)
    assert cost.per_read_s == pytest.approx(per_read, rel=1e-2)
    # a prefill in chunks costs what it costs in one step, but for reading its context again
    chunked = cost.prefill_s(100, 500) + cost.prefill_s(100, 600)
    assert chunked == pytest.approx(cost.prefill_s(200, 500) + 600 * cost.per_read_s)
    # a long run of decodes (their cost mostly reads) does not make it forget what the prefills taught
    # it, nor does it pass for a step's fixed cost
    for _ in range(200):
        observe(1, 2000)
    assert cost.per_token_s == pytest.approx(per_token, rel=1e-2)
    assert cost.overhead_s == pytest.approx(overhead, rel=0.05)
    assert cost.tokens_within(seconds(256, 0)) == pytest.approx(256, abs=1)
    # a short target would spend most of each step on its fixed cost: at most a tenth of it
    floor = cost.tokens_within(overhead + 48 * per_token)
    assert floor > 48 and seconds(floor, 0) == pytest.approx(10 * overhead, rel=0.05)
    # after a long context each token costs more: the step takes fewer to last as long
    assert cost.tokens_within(seconds(256, 1024), context=1024) == pytest.approx(256, abs=1)
    # ... and so does the overhead floor, which is a time: a step of its tokens lasts ten overheads
    floor_at_context = cost.tokens_within(overhead + 48 * per_token, context=1024)
    assert floor_at_context < floor
    assert seconds(floor_at_context, 1024) == pytest.approx(10 * overhead, rel=0.05)


def test_waiting_requests_are_ordered_without_asking_the_lower_tiers_at_every_step(monkeypatch):
    """The scheduler estimates every waiting request's work at every step. A lower tier may be a remote
    server a round trip away: what the lower tiers hold is asked again only after a while, what the
    device holds at once."""
    import kvstrata.engine.kv_manager as kv_manager

    kv = make_stack(device_blocks=64, cpu_blocks=64)
    cpu, lookups = kv.hierarchy.cpu, []
    count_prefixes = cpu.count_prefixes  # (a chain's lookup asks the tier one chain of all it asks at once)
    monkeypatch.setattr(cpu, "count_prefixes",
                        lambda chains: (lookups.extend(map(len, chains)), count_prefixes(chains))[1])
    document = list(range(1000, 1000 + 8 * BS))
    waiting = new_request(document + [1, 2, 3])
    assert kv.estimate_uncached(waiting).tokens == waiting.num_tokens  # a miss everywhere
    assert len(lookups) == 1
    for _ in range(20):
        kv.estimate_uncached(waiting)
    assert len(lookups) == 1

    # another request computes the document on the device: the waiting one's estimate sees it at once
    other = new_request(document + [4, 5, 6])
    blocks, _, _ = kv.get_computed_blocks(other)
    kv.allocate_slots(other, other.num_tokens, blocks)  # its full blocks are cached as it is scheduled
    asked = len(lookups)
    estimate = kv.estimate_uncached(waiting)
    assert estimate.hit_blocks["device"] == 8 and estimate.tokens == waiting.num_tokens - 8 * BS
    assert len(lookups) == asked

    missing = new_request(list(range(5000, 5000 + 4 * BS)) + [1])
    kv.estimate_uncached(missing)
    kv.estimate_uncached(missing)
    assert len(lookups) == asked + 1
    monkeypatch.setattr(kv_manager, "LOWER_LOOKUP_REFRESH_S", 0.0)  # the while has passed: asked again
    kv.estimate_uncached(missing)
    assert len(lookups) == asked + 2


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_requests_waiting_for_a_sequence_slot_are_not_looked_up_until_one_is_free(policy, monkeypatch):
    """While every sequence slot is taken, no waiting request can start: none is priced or looked up at each
    step (many clients queue exactly then); once a slot frees, the shortest work is admitted first."""
    kv, scheduler, clock = make_scheduler(policy, seconds_per_token=1.0)  # the long one is not overdue meanwhile
    scheduler.max_num_seqs = 2
    first = add(scheduler, clock, doc(1, 2 * BS), max_tokens=6)
    add(scheduler, clock, doc(2, 2 * BS), max_tokens=30)
    for _ in range(3):
        step(kv, scheduler, clock)
    long_one = add(scheduler, clock, doc(3, 3 * BS))
    short_one = add(scheduler, clock, cached_question(kv, 4, doc_blocks=2))
    estimates = []
    estimate_uncached_many = kv.estimate_uncached_many
    monkeypatch.setattr(kv, "estimate_uncached_many", lambda rs: (estimates.extend(rs), estimate_uncached_many(rs))[1])
    while first in scheduler.running:
        assert step(kv, scheduler, clock) and not estimates
    admitted = step(kv, scheduler, clock)  # one slot: by work, or by arrival
    assert list(admitted)[-1] is (short_one if policy == "uncached_first" else long_one)


def test_while_the_first_in_line_is_refused_for_room_only_requests_that_arrive_since_are_priced(monkeypatch):
    """A step's admissions end at the first request refused for room: while it stays refused the requests behind
    it are not priced again at every step (a long queue behind a full device made every step longer). One that
    arrives is priced, and goes first if its work is less; once room frees, all are ordered again."""
    kv, scheduler, clock = make_scheduler("uncached_first", budget=256, device_blocks=12, seconds_per_token=1.0)
    holder = add(scheduler, clock, doc(1, 7 * BS), max_tokens=8)  # up to 9 of the 12 blocks as it decodes
    step(kv, scheduler, clock)
    documents = [add(scheduler, clock, doc(10 + k, 6 * BS)) for k in range(3)]  # 6 blocks each: no room
    step(kv, scheduler, clock)  # all ordered; the first document is refused
    estimates = []  # the requests priced afresh (an estimate kept from an earlier step is not)
    estimate = kv._estimate
    monkeypatch.setattr(kv, "_estimate", lambda r, located: (estimates.append(r), estimate(r, located))[1])
    for _ in range(3):
        assert list(step(kv, scheduler, clock)) == [holder] and not estimates
    question = add(scheduler, clock, doc(20, 3))  # one block: there is room for it
    assert list(step(kv, scheduler, clock)) == [holder, question] and estimates == [question]
    while holder in scheduler.running:
        step(kv, scheduler, clock)
    estimates.clear()
    admitted = step(kv, scheduler, clock)  # room: every waiting request is priced again, the first is admitted
    assert set(estimates) == set(documents) and documents[0] in admitted


def test_a_request_the_device_has_no_room_for_is_tried_again_without_asking_the_lower_tiers(monkeypatch):
    """The first waiting request is tried at every step while the device is too full to load its prefix:
    the lower tiers (perhaps a remote server) are not asked again each time; once the device has room it is
    admitted on what they answered last, while that is recent (`LOWER_LOOKUP_REFRESH_S`)."""
    import kvstrata.engine.kv_manager as kv_manager

    kv = make_stack(device_blocks=16, cpu_blocks=64)
    cpu, lookups = kv.hierarchy.cpu, []
    count_prefixes = cpu.count_prefixes  # (a chain's lookup asks the tier one chain of all it asks at once)
    monkeypatch.setattr(cpu, "count_prefixes",
                        lambda chains: (lookups.extend(map(len, chains)), count_prefixes(chains))[1])
    document = doc(7, 8 * BS)
    run_request(kv, document + [1])  # written through to the CPU tier
    holder = run_request(kv, doc(8, 14 * BS), finish=False)  # holds 14 of the 16 device blocks

    question = new_request(document + [2, 3])
    asked = len(lookups)
    for _ in range(10):
        assert kv.get_computed_blocks(question) is None and not kv.holds_prefix(question)
    assert len(lookups) == asked + 1  # one lookup: the device's part is read again, the CPU tier's kept

    monkeypatch.setattr(kv_manager, "LOWER_LOOKUP_REFRESH_S", 0.0)  # after a while, the lower tiers are asked again
    assert kv.get_computed_blocks(question) is None
    assert len(lookups) == asked + 2
    monkeypatch.setattr(kv_manager, "LOWER_LOOKUP_REFRESH_S", 60.0)

    kv.free(holder)  # room: admitted on the kept lookup (the lower tiers asked a moment ago), which found the
    blocks, num_cached, by_tier = computed_blocks(kv, question)  # document in the CPU tier
    assert len(lookups) == asked + 2
    assert num_cached == 8 * BS and by_tier["cpu"] >= 6 * BS
    assert kv.allocate_slots(question, question.num_tokens - num_cached, blocks) is not None


def test_a_new_document_the_device_has_no_room_for_is_tried_again_without_asking_the_lower_tiers(monkeypatch):
    """The same for a prompt no tier holds, refused when its first chunk finds no free device block."""
    kv = make_stack(device_blocks=16, cpu_blocks=64)
    cpu, lookups = kv.hierarchy.cpu, []
    count_prefixes = cpu.count_prefixes  # (a chain's lookup asks the tier one chain of all it asks at once)
    monkeypatch.setattr(cpu, "count_prefixes",
                        lambda chains: (lookups.extend(map(len, chains)), count_prefixes(chains))[1])
    holder = run_request(kv, doc(8, 15 * BS), finish=False)  # holds 15 of the 16 device blocks
    new_document = new_request(doc(9, 6 * BS))
    asked = len(lookups)
    blocks, num_cached, _ = kv.get_computed_blocks(new_document)
    assert num_cached == 0 and kv.allocate_slots(new_document, 4 * BS, blocks) is None  # a chunk of 4 blocks
    for _ in range(10):
        assert kv.get_computed_blocks(new_document) is None and not kv.holds_prefix(new_document)
    assert len(lookups) == asked + 1

    other = run_request(kv, doc(10, BS - 1), finish=False)  # takes the last free block, then frees it:
    assert kv.get_computed_blocks(new_document) is None  # no more room than at the refusal
    kv.free(other)
    assert kv.get_computed_blocks(new_document) is None and len(lookups) == asked + 1
    kv.free(holder)  # admitted on the kept lookup: the lower tiers were asked a moment ago
    blocks, num_cached, _ = kv.get_computed_blocks(new_document)
    assert len(lookups) == asked + 1 and kv.allocate_slots(new_document, 4 * BS, blocks) is not None


def test_a_speed_that_changes_is_followed_and_the_old_one_forgotten_after_a_window():
    # the fit keeps running sums that measurements enter and leave: after thousands of them, the old
    # speed's share must be gone, not left over in the sums
    cost = ReadCost(block_nbytes=1 << 20)
    rng = random.Random(0)
    for _ in range(5000):
        blocks = rng.randint(3, 500)
        cost.observe(blocks, 0.002 + 1e-3 * blocks * rng.uniform(0.5, 1.5))
    for _ in range(WINDOW):
        blocks = rng.randint(3, 500)
        cost.observe(blocks, 0.004 + 2e-3 * blocks)  # the tier got slower
    assert cost.per_block_s == pytest.approx(2e-3, rel=1e-6)
    assert cost.latency_s == pytest.approx(0.004, rel=1e-4)


def test_step_cost_learns_the_fixed_cost_of_replayed_and_of_eager_steps_apart():
    """On a GPU a step replayed as a CUDA graph (decodes, questions) has a fixed cost 10-20x below an eager one
    (prefill chunks): one fixed cost for both priced a 2256-token eager step at a third of what it took."""
    eager, replayed, per_token = 0.025, 0.0015, 5e-6
    cost = StepCost(replay_tokens=511)
    for _ in range(4):
        for tokens in (1, 1, 1, 17, 64):
            cost.observe(tokens, replayed + per_token * tokens, replayed=True)
        for tokens in (2048, 1024, 4096):
            cost.observe(tokens, eager + per_token * tokens)
    assert cost.overhead_s == pytest.approx(eager, rel=0.02)
    assert cost.replayed_overhead_s == pytest.approx(replayed, rel=0.05)
    assert cost.per_token_s == pytest.approx(per_token, rel=0.02)
    # a step of its own is priced by its size: replayed up to replay_tokens, eager beyond
    assert cost.step_s(511, 0) == pytest.approx(replayed + 511 * per_token, rel=0.02)
    assert cost.step_s(512, 0) == pytest.approx(eager + 512 * per_token, rel=0.02)
    assert cost.step_s(0, 100) == 0.0
    # without graphs (a CPU) every step is eager, whatever its size
    assert StepCost(overhead_s=0.04, replayed_overhead_s=0.001).step_s(16, 0) == pytest.approx(0.04 + 16 * 2e-3)


def test_from_no_per_token_guess_two_eager_prefills_and_replayed_steps_tell_each_cost_apart():
    """The engine's start-up probe on one H200: an eager 2048-token prefill 25 ms, an eager 1024-token one 22 ms, a
    replayed decode over 2048 tokens 1.8 ms, a replayed 16-token prompt 2.5 ms. From the CPU's per-token guess the
    fit, underdetermined, kept the eager fixed cost at 0 and priced a 1216-token head at 15 ms (it took over 25)."""
    probe = [(0, 2048, 0.025, False), (0, 1024, 0.022, False), (2048, 1, 0.0018, True), (0, 16, 0.0025, True)]

    def probed(cost: StepCost) -> StepCost:
        for context, new, seconds, replayed in probe:
            cost.observe(new, seconds, attention_pairs(new, context), context + new, replayed=replayed)
        return cost
    cost = probed(StepCost(per_token_s=0.0, replay_tokens=511))
    assert cost.overhead_s == pytest.approx(0.019, rel=0.05)
    assert cost.step_s(1216, 0) > 0.02 and cost.step_s(16, 7024) < 0.005  # an eager head, a replayed question
    assert probed(StepCost(replay_tokens=511)).overhead_s == 0  # from the CPU's guess


def test_step_cost_stays_non_negative_by_fitting_again_not_by_clamping():
    # Whole documents and short questions after them: the unconstrained fit wants a negative cost per
    # attention pair. Held at 0, the others must be fitted again, or a whole prefill is overpriced.
    cost = StepCost()
    for tokens, context, seconds in [(2000, 0, 11.4), (48, 2000, 0.38), (48, 2000, 0.40), (20, 2040, 0.30)]:
        cost.observe(tokens, seconds, attention_pairs(tokens, context))
    assert min(cost.overhead_s, cost.per_token_s, cost.per_pair_s) >= 0
    assert cost.prefill_s(2000, 0) == pytest.approx(11.4 - cost.overhead_s, rel=0.05)


def test_a_whole_prefill_is_still_priced_right_after_a_long_run_of_hits():
    """What receipts report as prefill saved: a few whole documents computed, then many questions whose
    documents are cached (a few new tokens over a long context, and their decodes, whose cost is mostly
    reading the context). The price of computing a whole document must stay within 20% of its true
    cost, and a decode's reads must not pass for a step's fixed cost."""

    def true_s(tokens: int, context: int) -> float:
        return 0.02 + 4e-3 * tokens + 1e-6 * attention_pairs(tokens, context) + 1e-4 * (context + tokens)

    def observe(tokens: int, context: int) -> None:
        cost.observe(tokens, true_s(tokens, context), attention_pairs(tokens, context), context + tokens)

    cost = StepCost()
    rng = random.Random(0)
    for _ in range(3):
        observe(2040, 0)
        for k in range(8):
            observe(1, 2040 + k)
    for _ in range(40):
        question = rng.randint(20, 30)
        observe(question, 2016)
        for k in range(8):
            observe(1, 2016 + question + k)
    assert cost.prefill_s(2016, 0) == pytest.approx(true_s(2016, 0) - 0.02, rel=0.2)
    # The contexts are all alike, so reads and the fixed cost cannot be told fully apart; without
    # the reads the fit put 0.22 s on the fixed cost (11x), which the step cap's floor multiplies.
    assert 0.02 <= cost.overhead_s < 0.05


def test_unknown_policy_is_a_one_line_error():
    kv = make_stack(device_blocks=8)
    with pytest.raises(ValueError, match="scheduler.policy"):
        Scheduler(kv, 64, 4, policy="lifo")


def test_a_second_question_on_a_document_being_read_waits_for_it_instead_of_computing_it_twice():
    kv, scheduler, clock = make_scheduler("uncached_first", budget=64, share=0.25)
    document = doc(20, 40 * BS)
    first = add(scheduler, clock, document + doc(21, 3))
    assert step(kv, scheduler, clock) == {first: 64}
    second = add(scheduler, clock, document + doc(22, 3))  # the same document, another question
    other = add(scheduler, clock, cached_question(kv, 23))  # short work: leaves room in the step
    scheduled = step(kv, scheduler, clock)
    assert scheduled[other] == 5 and scheduled[first] == 16  # budget left over, yet ...
    assert second not in scheduled  # ... the second question does not read the document beside the first
    while first.num_computed_tokens < len(document):
        assert second not in step(kv, scheduler, clock)
    step(kv, scheduler, clock)
    assert second.cached_tokens_by_tier["device"] == len(document)  # it found the whole document cached
    assert second.num_computed_tokens == second.num_prompt_tokens  # and computed only its question


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_a_burst_of_arrivals_is_looked_up_together_and_admitted_on_that_lookup(policy, monkeypatch):
    """Requests that arrive together are looked up with one question to each lower tier (to a remote server, one
    round trip for all of them, where each cost one), and their admissions in that step start from that lookup:
    no tier is asked anything more. Each gets the prefix a lookup of its own finds."""
    kv = make_stack(device_blocks=128, cpu_blocks=64)
    documents = [doc(30 + k, 4 * BS) for k in range(3)]
    for document in documents:
        run_request(kv, document + [1])  # written through to the CPU tier
    assert kv.hierarchy.clear_device_cache()
    clock = FakeClock()
    scheduler = Scheduler(kv, max_num_batched_tokens=1024, max_num_seqs=16, policy=policy, clock=clock)
    kv.step_cost = StepCost(per_token_s=0.01)
    on_documents = [add(scheduler, clock, document + doc(40 + k, 5)) for k, document in enumerate(documents)]
    new = [add(scheduler, clock, doc(50 + k, 3 * BS + 2)) for k in range(3)]  # found nowhere
    cpu, asked = kv.hierarchy.cpu, []
    count_prefixes = cpu.count_prefixes
    monkeypatch.setattr(cpu, "count_prefixes", lambda chains: (asked.append(len(chains)), count_prefixes(chains))[1])
    admitted = step(kv, scheduler, clock)  # the questions' documents start loading; the new requests run
    assert asked == [6]
    assert set(admitted) == set(new) and all(r.status == RequestStatus.LOADING for r in on_documents)
    kv.hierarchy.transfers.wait_idle()
    admitted = step(kv, scheduler, clock)
    assert set(on_documents) <= set(admitted) and asked == [6]
    assert all(r.cached_tokens_by_tier["cpu"] == 4 * BS for r in on_documents)
