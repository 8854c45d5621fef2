"""Scheduler without a model: build Requests, call schedule(), feed back fake sampled tokens."""

from __future__ import annotations

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import RuntimeInfo, SchedulerConfig
from splitserve.services.engine.kv_cache.manager import KVCacheManager, cdiv
from splitserve.services.engine.request import FinishReason, Request, RequestId, RequestStatus
from splitserve.services.engine.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 999
NEXT_TOKEN = 7  # what the fake model always samples (never EOS)


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
    chunked: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    runtime = RuntimeInfo(
        num_kv_blocks=num_blocks, block_size=BS, max_model_len=max_model_len, eos_token_ids=frozenset({EOS})
    )
    return Scheduler(config, runtime, KVCacheManager(num_blocks, BS))


def make_request(rid: str, prompt: list[int] | int, *, max_tokens: int = 4, priority: int = 0) -> Request:
    prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(
        RequestId(rid),
        prompt_ids,
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        block_size=BS,
        priority=priority,
    )


def step(sched: Scheduler, token: int = NEXT_TOKEN) -> SchedulerOutput:
    out = sched.schedule()
    check_output(sched, out)
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    sched.update_after_step(out, sampled)
    return out


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every step must satisfy, whatever the workload."""
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert sched.num_running <= sched.config.max_num_seqs
    sizes = [s.num_new_tokens for s in out.scheduled]
    assert sizes == sorted(sizes, key=lambda n: n != 1), f"decodes must come first: {sizes}"
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens >= 1
        assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        assert len(s.block_ids) >= cdiv(r.num_computed_tokens + s.num_new_tokens, sched.kv.block_size)
        assert s.block_ids == sched.kv.block_ids(r.request_id)
    for r in out.preempted:
        assert r not in [s.request for s in out.scheduled]
        assert not sched.kv.holds(r.request_id)


def run_until_done(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
    return outs


def all_blocks_free(sched: Scheduler) -> bool:
    pool = sched.kv.pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


# -- ordering and budgets ---------------------------------------------------------------------------


def test_first_step_prefills_then_decodes_one_token_each():
    sched = make_scheduler()
    a, b = make_request("a", 6), make_request("b", 9)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 6), (b, 9)]
    assert a.output_token_ids == [NEXT_TOKEN] and a.num_computed_tokens == 6
    out = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    assert a.num_computed_tokens == 7 and a.num_tokens == 8


def test_decodes_are_scheduled_before_prefills():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_request("a", 3, max_tokens=10), make_request("b", 15)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 3 (samples), b: first chunk of 7
    assert b.num_computed_tokens == 7
    c = make_request("c", 1)  # a one-token prompt is decode-shaped
    sched.add_request(c)
    d = make_request("d", 5)
    sched.add_request(d)
    out = sched.schedule()
    # Scheduled in the order a, b, c; the output puts the one-token entries first, stably.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("c", 1), ("b", 8)]
    assert d.status == RequestStatus.WAITING  # the budget (1 + 8 + 1 = 10) is spent


def test_chunked_prefill_splits_prompt_and_samples_only_on_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    r = make_request("r", 20)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (s,) = out.scheduled
        samples = s.samples  # read before the update moves num_computed_tokens
        chunks.append((s.num_new_tokens, samples))
        sched.update_after_step(out, {r.request_id: NEXT_TOKEN} if samples else {})
        assert r.num_output_tokens == (1 if samples else 0)
    assert chunks == [(8, False), (8, False), (4, True)]
    assert r.num_computed_tokens == 20 and r.num_tokens == 21
    assert sched.kv.num_blocks_of("r") == 5


def test_token_budget_shared_across_requests():
    sched = make_scheduler(max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", 7, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [7, 7, 2]
    assert out.num_batched_tokens == 16
    assert reqs[3].status == RequestStatus.WAITING
    run_until_done(sched)
    assert all(r.num_output_tokens == 3 for r in reqs)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=10, chunked=False)
    a, b = make_request("a", 6), make_request("b", [9] * 6)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [s.request for s in out.scheduled] == [a]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    out = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 4, max_tokens=2 + i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [s.request for s in out.scheduled] == reqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1
    step(sched)  # r0 reaches max_tokens=2 and finishes
    assert reqs[0].status == RequestStatus.FINISHED_LENGTH
    out = step(sched)
    assert [s.request for s in out.scheduled] == [reqs[1], reqs[2]]
    run_until_done(sched)
    assert all_blocks_free(sched)


def _admission_order(policy: str) -> list[str]:
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for rid, priority in [("p2", 2), ("p0a", 0), ("p1", 1), ("p0b", 0)]:
        sched.add_request(make_request(rid, 4, max_tokens=1, priority=priority))
    order = []
    for out in run_until_done(sched):
        order += [s.request.request_id for s in out.scheduled if s.request.request_id not in order]
    return order


def test_fcfs_admits_in_arrival_order():
    assert _admission_order("fcfs") == ["p2", "p0a", "p1", "p0b"]


def test_priority_admits_lowest_value_first_then_arrival():
    assert _admission_order("priority") == ["p0a", "p0b", "p1", "p2"]


# -- preemption -------------------------------------------------------------------------------------


def test_preemption_picks_latest_arrival_frees_its_blocks_and_it_completes():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):  # 8 tokens each fill all 4 blocks
        out = step(sched)
        assert out.preempted == []
    assert a.num_tokens == 8 and sched.kv.num_free_blocks == 0
    for _ in range(2):  # computing token 8 fits; the 9th needs a 5th block
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == [b]
    assert [s.request for s in out.scheduled] == [a]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert not sched.kv.holds("b")
    assert list(sched.waiting) == [b] and sched.running == [a]
    run_until_done(sched)
    assert a.output_token_ids == b.output_token_ids == [NEXT_TOKEN] * 8
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
    assert all_blocks_free(sched)


def test_preemption_picks_lowest_priority_even_if_it_arrived_first():
    sched = make_scheduler(num_blocks=4, policy="priority")
    low, high = make_request("low", 4, max_tokens=8, priority=1), make_request("high", 4, max_tokens=8)
    sched.add_request(low)
    sched.add_request(high)
    preempted = []
    for out in run_until_done(sched):
        preempted += out.preempted
    assert preempted and set(preempted) == {low}
    assert high.num_preemptions == 0
    assert low.num_output_tokens == high.num_output_tokens == 8
    assert all_blocks_free(sched)


def test_preempting_a_request_already_scheduled_this_step_refunds_its_tokens():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8, policy="priority")
    low = make_request("low", [5], max_tokens=8, priority=5)
    sched.add_request(low)
    step(sched)
    high = make_request("high", list(range(100, 115)), max_tokens=2, priority=0)
    sched.add_request(high)
    out = step(sched)  # low decodes 1; high takes the other 7 tokens of budget (2 blocks)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(low, 1), (high, 7)]
    assert sched.running == [low, high] and sched.kv.num_free_blocks == 1
    # Next step low is scheduled first, then high's last 8 prompt tokens need 2 blocks, 1 is free:
    # low (lowest priority, though ahead in the running list) is preempted and its token refunded.
    out = step(sched)
    assert out.preempted == [low]
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(high, 8)]
    assert sched.running == [high] and not sched.kv.holds("low")
    assert list(sched.waiting) == [low] and low.num_computed_tokens == 0
    run_until_done(sched)
    assert high.num_preemptions == 0 and low.num_preemptions == 1
    assert low.output_token_ids == [NEXT_TOKEN] * 8 and high.output_token_ids == [NEXT_TOKEN] * 2
    assert all_blocks_free(sched)


def test_no_admission_in_a_step_that_preempts():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    late = make_request("late", 1, max_tokens=1)
    sched.add_request(late)
    out = step(sched)
    while not out.preempted:
        assert late.status == RequestStatus.WAITING
        out = step(sched)
    assert late not in [s.request for s in out.scheduled]
    run_until_done(sched)
    assert late.num_output_tokens == 1 and all_blocks_free(sched)


# -- finishing --------------------------------------------------------------------------------------


def test_finish_request_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=16)
    running, waiting = make_request("running", 10, max_tokens=50), make_request("waiting", 10)
    sched.add_request(running)
    step(sched)
    sched.add_request(waiting)
    assert sched.kv.num_free_blocks == 16 - 3
    assert sched.finish_request("running", RequestStatus.FINISHED_ABORTED) is running
    assert running.finish_reason == FinishReason.ABORT
    assert all_blocks_free(sched) and sched.num_running == 0
    assert sched.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is waiting
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    assert sched.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is None
    assert sched.schedule().is_empty


def test_abort_of_a_preempted_request_removes_it_from_waiting():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not (out := step(sched)).preempted:
        pass
    assert out.preempted == [b]
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0
    run_until_done(sched)
    assert all_blocks_free(sched)


def test_eos_and_max_tokens_finish_and_free():
    sched = make_scheduler()
    r, s = make_request("eos", 5, max_tokens=10), make_request("len", 5, max_tokens=2)
    sched.add_request(r)
    sched.add_request(s)
    out = sched.schedule()
    sched.update_after_step(out, {"eos": NEXT_TOKEN, "len": NEXT_TOKEN})
    out = sched.schedule()
    advanced = sched.update_after_step(out, {"eos": EOS, "len": NEXT_TOKEN})
    assert advanced == [r, s]
    assert r.status == RequestStatus.FINISHED_STOPPED and s.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished() and all_blocks_free(sched)


def test_max_model_len_finishes_a_request():
    sched = make_scheduler(max_model_len=8)
    r = make_request("r", 6, max_tokens=100)
    sched.add_request(r)
    run_until_done(sched)
    assert r.num_tokens == 8 and r.status == RequestStatus.FINISHED_LENGTH


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 3))


def test_pool_is_all_free_after_a_mixed_workload():
    sched = make_scheduler(num_blocks=12, max_num_seqs=3, max_num_batched_tokens=12, policy="priority")
    reqs = [
        make_request(f"r{i}", [1 + (i * j) % 5 for j in range(3 + 5 * i % 17)], max_tokens=1 + i % 7, priority=i % 3)
        for i in range(10)
    ]
    for r in reqs:
        sched.add_request(r)
    outs = run_until_done(sched)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert any(out.preempted for out in outs)  # the pool is small enough to force preemption
    assert all_blocks_free(sched)


# -- prefix cache -------------------------------------------------------------------------------------


def test_prefix_hit_sets_cached_and_computed_tokens():
    sched = make_scheduler()
    prompt = list(range(10, 22))  # 3 full blocks
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    out = step(sched)
    first_block_ids = out.scheduled[0].block_ids
    assert first.is_finished and first.num_cached_tokens == 0 and all_blocks_free(sched)
    second = make_request("second", prompt[:10] + [50, 51])  # shares 2 full blocks with first
    sched.add_request(second)
    out = sched.schedule()
    (s,) = out.scheduled
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 8
    assert s.num_new_tokens == 4 and s.samples
    assert s.block_ids[:2] == first_block_ids[:2]
    assert s.block_ids[2] not in first_block_ids
    sched.update_after_step(out, {"second": NEXT_TOKEN})
    assert second.num_computed_tokens == 12
    # Whole prompt cached: hits come in whole blocks and leave >= 1 token, so 8 of 12 are reused.
    third = make_request("third", prompt)
    sched.add_request(third)
    out = sched.schedule()
    t = next(x for x in out.scheduled if x.request is third)
    assert third.num_cached_tokens == 8 and third.num_computed_tokens == 8 and t.num_new_tokens == 4
    assert t.block_ids[:2] == first_block_ids[:2]
    assert sched.kv.pool.blocks[first_block_ids[0]].ref_cnt == 2


def test_no_prefix_hit_for_unrelated_prompt():
    sched = make_scheduler()
    sched.add_request(make_request("first", list(range(10, 22)), max_tokens=1))
    run_until_done(sched)
    other = make_request("other", list(range(30, 42)))
    sched.add_request(other)
    (s,) = sched.schedule().scheduled
    assert other.num_cached_tokens == 0 and s.num_new_tokens == 12


def test_preempted_request_keeps_its_first_num_cached_tokens():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    while not step(sched).preempted:
        pass
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 0
    while b.status != RequestStatus.RUNNING:
        out = sched.schedule()
        sched.update_after_step(out, {s.request.request_id: NEXT_TOKEN for s in out.scheduled if s.samples})
    # b came back through its own cached first block, but num_cached_tokens keeps the first value.
    resumed = next(s for s in out.scheduled if s.request is b)
    assert resumed.num_new_tokens < b.num_tokens
    assert b.num_cached_tokens == 0
    run_until_done(sched)
    assert b.num_output_tokens == 8 and all_blocks_free(sched)


def test_abort_between_schedule_and_update_is_harmless():
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.services.engine.config import RuntimeInfo, SchedulerConfig
    from splitserve.services.engine.kv_cache.manager import KVCacheManager
    from splitserve.services.engine.request import Request, RequestStatus
    from splitserve.services.engine.scheduler import Scheduler

    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(), RuntimeInfo(8, 4, 64, frozenset()), kv)
    r = Request(
        "r", list(range(8)), SamplingParams(max_tokens=4), max_tokens=4, eos_token_ids=frozenset(), block_size=4
    )
    sched.add_request(r)
    out = sched.schedule()
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert sched.update_after_step(out, {"r": 7}) == []
    assert r.num_output_tokens == 0 and kv.num_free_blocks == 8


def test_fcfs_preempts_the_latest_arrival_whatever_its_priority():
    sched = make_scheduler(num_blocks=4, policy="fcfs")
    early, late = make_request("early", 4, max_tokens=8, priority=5), make_request("late", 4, max_tokens=8)
    sched.add_request(early)
    sched.add_request(late)
    preempted = []
    for out in run_until_done(sched):
        preempted += out.preempted
    assert preempted and set(preempted) == {late}  # priority is ignored under fcfs
    assert early.num_preemptions == 0
    assert all_blocks_free(sched)


# -- decode tier: KV transferred from a prefill worker -----------------------------------------------


def land(sched: Scheduler, request: Request, first_token: int = NEXT_TOKEN) -> None:
    """What the decode worker does: the first token arrives (Engine.accept_first_token), then the KV."""
    request.append_output_token(first_token)
    sched.admit_transferred(request.request_id)


def test_landed_requests_join_before_a_head_that_does_not_fit():
    sched = make_scheduler(num_blocks=8)
    head = make_request("head", list(range(100, 120)))  # 5 blocks, first to arrive
    sched.add_request(head)
    # 6 tokens: its first token fits in its 2 reserved blocks; 8 tokens: its first token needs a 3rd.
    t6, t8 = make_request("t6", list(range(200, 206))), make_request("t8", list(range(300, 308)))
    assert sched.reserve_for_transfer(t6) == 0 and sched.reserve_for_transfer(t8) == 0
    land(sched, t6)
    land(sched, t8)
    assert sched.kv.num_free_blocks == 4 and list(sched.waiting) == [t6, t8, head]
    out = step(sched)
    # Before the fix: the head came first, needed 5 of 4 free blocks, and nothing ever ran again.
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(t6, 1), (t8, 1)]
    assert head.status == RequestStatus.WAITING and sched.kv.num_free_blocks == 3
    run_until_done(sched)
    assert head.num_output_tokens == t6.num_output_tokens == t8.num_output_tokens == 4
    assert all_blocks_free(sched)


def test_a_landed_request_needing_no_block_passes_one_that_needs_a_block():
    sched = make_scheduler(num_blocks=8)
    t8, t6 = make_request("t8", list(range(300, 308))), make_request("t6", list(range(200, 206)))
    assert sched.reserve_for_transfer(t8) == 0 and sched.reserve_for_transfer(t6) == 0
    running = make_request("running", list(range(100, 115)), max_tokens=2)  # takes the last 4 blocks
    sched.add_request(running)
    step(sched)
    land(sched, t8)
    land(sched, t6)
    assert sched.kv.num_free_blocks == 0 and list(sched.waiting) == [t8, t6]
    out = step(sched)  # running's 16th token fits its 4th block; t8's 9th token needs a 3rd block
    assert [s.request for s in out.scheduled] == [running, t6]
    assert t8.status == RequestStatus.WAITING
    run_until_done(sched)
    assert t8.num_output_tokens == t6.num_output_tokens == 4 and all_blocks_free(sched)


def test_only_requests_holding_blocks_pass_a_head_that_does_not_fit():
    sched = make_scheduler(num_blocks=8)
    t = make_request("t", list(range(200, 216)))  # 4 blocks
    assert sched.reserve_for_transfer(t) == 0
    head, small = make_request("head", list(range(100, 120))), make_request("small", [300])
    sched.add_request(head)
    sched.add_request(small)
    land(sched, t)
    out = sched.schedule()
    # t arrived first and runs; head needs 5 of the 4 free blocks; small fits but waits its turn.
    assert [s.request for s in out.scheduled] == [t]
    assert list(sched.waiting) == [head, small]


def test_landed_requests_passing_the_head_respect_max_num_seqs():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    head = make_request("head", list(range(100, 160)))  # 15 blocks
    sched.add_request(head)
    t1, t2 = make_request("t1", list(range(200, 203))), make_request("t2", list(range(300, 303)))
    assert sched.reserve_for_transfer(t1) == 0 and sched.reserve_for_transfer(t2) == 0
    land(sched, t1)
    land(sched, t2)
    out = step(sched)
    assert [s.request for s in out.scheduled] == [t1]
    run_until_done(sched)
    assert head.num_output_tokens == 4 and all_blocks_free(sched)


def test_an_aborted_pinned_reservation_parks_its_blocks_until_unpinned():
    """A transfer writes a pinned reservation's blocks as its bytes land: an abort meanwhile must not
    hand those blocks to another request before the writes end (unpin)."""
    sched = make_scheduler(num_blocks=8)
    t = make_request("t", list(range(200, 216)))  # 4 blocks
    assert sched.reserve_for_transfer(t) == 0 and sched.pin_reserved("t")
    sched.finish_request("t", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 4 and sched.kv.is_parked("t") and not sched.awaiting_kv
    other = make_request("other", list(range(300, 316)))
    assert sched.reserve_for_transfer(other) is None  # 4 free blocks, one kept free: the parked 4 are not reused
    sched.unpin("t")
    assert all_blocks_free(sched) and not sched.kv.is_parked("t")
    assert not sched.pin_reserved("t")  # gone: nothing to pin


def test_a_pinned_reservation_recomputed_parks_the_old_blocks_and_takes_new_ones():
    sched = make_scheduler(num_blocks=12)
    t = make_request("t", list(range(200, 216)))
    assert sched.reserve_for_transfer(t) == 0 and sched.pin_reserved("t")
    t.append_output_token(NEXT_TOKEN)
    sched.recompute_locally("t")
    assert sched.kv.is_parked("t") and sched.kv.num_free_blocks == 8
    step(sched)  # the prompt is prefilled here, into 5 other blocks
    assert sched.kv.num_free_blocks == 3 and t.status == RequestStatus.RUNNING
    sched.unpin("t")
    assert sched.kv.num_free_blocks == 7 and not sched.kv.is_parked("t")
    run_until_done(sched)
    assert all_blocks_free(sched)


def test_a_landed_pinned_reservation_frees_its_blocks_when_it_finishes():
    sched = make_scheduler(num_blocks=8)
    t = make_request("t", list(range(200, 216)))
    assert sched.reserve_for_transfer(t) == 0 and sched.pin_reserved("t")
    land(sched, t)  # every write had ended: admitting it drops the pin
    run_until_done(sched)
    assert all_blocks_free(sched) and not sched.kv.is_parked("t")


def test_reservation_leaves_a_free_block_per_request_holding_blocks():
    sched = make_scheduler(num_blocks=8)
    running = make_request("running", list(range(100, 107)), max_tokens=20)  # 2 blocks
    sched.add_request(running)
    step(sched)
    assert sched.kv.num_free_blocks == 6
    # 5 blocks would leave 1 free block for 2 requests that may each need one more: refused.
    too_big = make_request("too_big", list(range(200, 220)))
    assert sched.reserve_for_transfer(too_big) is None
    assert sched.kv.num_free_blocks == 6 and not sched.kv.holds("too_big")
    assert "too_big" not in sched.requests and not sched.awaiting_kv
    fits = make_request("fits", list(range(300, 316)))  # 4 blocks, leaving 2
    assert sched.reserve_for_transfer(fits) == 0
    assert sched.kv.num_free_blocks == 2 and sched.awaiting_kv == {"fits": fits}
    # Now 2 requests hold blocks and 2 are free: a 1-block prompt would leave 1 for 3 of them.
    assert sched.reserve_for_transfer(make_request("one", [400])) is None


def test_refused_reservation_keeps_the_prefix_cache():
    sched = make_scheduler(num_blocks=4)
    cached = make_request("cached", list(range(100, 109)), max_tokens=1)  # 2 full blocks cached
    sched.add_request(cached)
    run_until_done(sched)
    num_cached = sched.kv.pool.num_cached_blocks()
    assert num_cached == 2
    # 4 new blocks would leave none free: refused before any allocation evicts a cached block.
    refused = make_request("refused", list(range(500, 516)))
    assert sched.reserve_for_transfer(refused) is None
    assert sched.kv.pool.num_cached_blocks() == num_cached and all_blocks_free(sched)


def test_a_reservation_without_room_waits_in_the_scheduler_and_is_made_in_arrival_order():
    """No room: the reservation waits in awaiting_room (not retried by its caller) and is made at the
    first chance after blocks are freed, in arrival order: a large prompt first holds back a small
    one that would fit, so a stream of small prompts cannot starve it."""
    sched = make_scheduler(num_blocks=8)
    running = make_request("running", list(range(100, 115)), max_tokens=3)  # 4 blocks
    sched.add_request(running)
    step(sched)
    made: list[tuple[str, int]] = []
    big, small = make_request("big", list(range(200, 212))), make_request("small", [300])  # 3 blocks, 1 block
    sched.queue_reservation(big, lambda num_held: made.append(("big", num_held)))
    sched.queue_reservation(small, lambda num_held: made.append(("small", num_held)))
    assert not made and list(sched.awaiting_room) == ["big", "small"] and not sched.awaiting_kv
    sched.reserve_queued()
    assert not made  # nothing was freed
    with pytest.raises(ValueError, match="already in use"):
        sched.queue_reservation(make_request("big", [1]), lambda _: None)
    run_until_done(sched)  # the running request finishes: its blocks come back
    sched.reserve_queued()
    assert made == [("big", 0), ("small", 0)] and not sched.awaiting_room
    assert set(sched.awaiting_kv) == {"big", "small"}


def test_an_aborted_reservation_leaves_the_queue_without_being_made():
    sched = make_scheduler(num_blocks=8)
    running = make_request("running", list(range(100, 119)), max_tokens=3)  # 5 blocks
    sched.add_request(running)
    step(sched)
    made: list[int] = []
    queued = make_request("queued", list(range(200, 212)))
    sched.queue_reservation(queued, made.append)
    assert sched.finish_request("queued", RequestStatus.FINISHED_ABORTED) is queued
    assert queued.status is RequestStatus.FINISHED_ABORTED and not sched.awaiting_room
    run_until_done(sched)
    sched.reserve_queued()
    assert not made and not sched.kv.holds("queued") and all_blocks_free(sched)
