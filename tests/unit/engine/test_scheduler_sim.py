"""Randomized scheduler simulation: Scheduler + KVCacheManager driven by random events, no model.

Each seed draws a small pool (8-32 blocks of 2-4 tokens) and a scheduler config, then applies
random events: add, abort, reserve_for_transfer, the first token of a transfer, land
(admit_transferred), recompute_locally and steps of a fake model (random tokens, sometimes EOS,
which finishes requests; small pools force preemptions). After every event the block accounting
must be exact. Then liveness: no new arrivals, every awaiting transfer lands, and stepping must
finish every request within a bound (a request that stops moving is a deadlock).

A failing seed reproduces alone: `run_sim(seed)`.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from suites import seeds
from test_scheduler import check_output

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import RuntimeInfo, SchedulerConfig
from splitserve.services.engine.kv_cache.manager import KVCacheManager, cdiv
from splitserve.services.engine.request import Request, RequestId, RequestStatus
from splitserve.services.engine.scheduler import Scheduler

EOS = 99
VOCAB = range(1, 6)  # a small vocabulary, so prompts share prefixes and hit the prefix cache
NUM_SEEDS = 100
NUM_EVENTS = 300


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_blocks: int
    block_size: int
    scheduler: SchedulerConfig
    enable_caching: bool
    eos_chance: float

    @staticmethod
    def draw(rng: random.Random) -> SimConfig:
        max_num_seqs = rng.randint(1, 6)
        chunked = rng.random() < 0.75
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=rng.randint(max(max_num_seqs, 8), 32),
            enable_chunked_prefill=chunked,
            policy=rng.choice(["fcfs", "priority"]),
        )
        return SimConfig(
            rng.randint(8, 32),
            rng.randint(2, 4),
            scheduler,
            enable_caching=rng.random() < 0.8,
            eos_chance=rng.choice([0.0, 0.05, 0.2]),
        )


class Sim:
    """One scheduler plus the fake model and the fake prefill worker around it."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cfg = SimConfig.draw(self.rng)
        runtime = RuntimeInfo(
            num_kv_blocks=self.cfg.num_blocks,
            block_size=self.cfg.block_size,
            max_model_len=1024,
            eos_token_ids=frozenset({EOS}),
        )
        kv = KVCacheManager(self.cfg.num_blocks, self.cfg.block_size, self.cfg.enable_caching)
        self.sched = Scheduler(self.cfg.scheduler, runtime, kv)
        self.all_requests: list[Request] = []
        self.num_landed = 0

    # -- requests -------------------------------------------------------------------------------
    def new_request(self) -> Request:
        """A request the pool could hold alone (and, without chunking, one step could compute)."""
        rng, cfg = self.rng, self.cfg
        capacity = cfg.num_blocks * cfg.block_size
        if not cfg.scheduler.enable_chunked_prefill:
            capacity = min(capacity, cfg.scheduler.max_num_batched_tokens)
        num_prompt = rng.randint(1, min(capacity - 1, 24))
        max_tokens = rng.randint(1, min(capacity - num_prompt, 8))
        prompt = [rng.choice(VOCAB) for _ in range(num_prompt)]
        request = Request(
            RequestId(f"r{len(self.all_requests)}"),
            prompt,
            SamplingParams(max_tokens=max_tokens),
            max_tokens=max_tokens,
            eos_token_ids=frozenset({EOS}),
            block_size=cfg.block_size,
            priority=rng.randint(0, 2),
        )
        self.all_requests.append(request)
        return request

    def sample(self) -> int:
        return EOS if self.rng.random() < self.cfg.eos_chance else self.rng.choice(VOCAB)

    def pick(self, request_ids) -> str | None:
        request_ids = list(request_ids)
        return self.rng.choice(request_ids) if request_ids else None

    # -- events ---------------------------------------------------------------------------------
    def add(self) -> None:
        self.sched.add_request(self.new_request())

    def reserve(self) -> None:
        self.sched.reserve_for_transfer(self.new_request())  # None (pool full) drops it

    def first_token(self, request_id: str | None = None) -> None:
        """The prefill worker's first token, as Engine.accept_first_token takes it."""
        request_id = request_id or self.pick(self.sched.awaiting_kv)
        request = self.sched.awaiting_kv.get(request_id) if request_id else None
        if request is None or request.num_output_tokens:
            return
        request.append_output_token(self.sample())
        status = request.check_stop(self.sched.runtime.max_model_len)
        if status is not None:
            self.sched.finish_request(request_id, status)

    def land(self, request_id: str | None = None) -> None:
        request_id = request_id or self.pick(self.sched.awaiting_kv)
        self.first_token(request_id)  # the first token always comes before the blocks
        if request_id in self.sched.awaiting_kv:
            self.sched.admit_transferred(request_id)
            self.num_landed += 1

    def recompute(self) -> None:
        request_id = self.pick(self.sched.awaiting_kv)
        self.first_token(request_id)
        if request_id in self.sched.awaiting_kv:
            self.sched.recompute_locally(request_id)

    def abort(self) -> None:
        request_id = self.pick(self.sched.requests)
        if request_id is not None:
            self.sched.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        out = self.sched.schedule()
        check_output(self.sched, out)
        sampled = {s.request.request_id: self.sample() for s in out.scheduled if s.samples}
        self.sched.update_after_step(out, sampled)

    EVENTS = (add, reserve, first_token, land, recompute, abort, step)
    WEIGHTS = (6, 6, 3, 4, 1, 1, 14)

    def random_event(self) -> None:
        event = self.rng.choices(self.EVENTS, self.WEIGHTS)[0]
        event(self)

    # -- liveness -------------------------------------------------------------------------------
    def drain(self) -> None:
        """No more arrivals: land every transfer and step until everything finishes."""
        for request_id in list(self.sched.awaiting_kv):
            self.land(request_id)
            self.check_blocks()
        # Not a proof: with no arrivals most steps compute a token of every running request, whose
        # tokens number at most prompt + max_tokens; recompute after preemption adds some. Seeds
        # 0-299 finish within 0.6 of this bound; a deadlocked one never finishes.
        bound = sum(r.num_prompt_tokens + r.max_tokens for r in self.sched.requests.values()) + 16
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.step()
            self.check_blocks()
        stuck = list(self.sched.waiting)[:4]
        assert not self.sched.has_unfinished(), (
            f"deadlock: {len(self.sched.requests)} requests unfinished after {bound} steps, "
            f"{self.sched.kv.num_free_blocks} blocks free, {len(self.sched.running)} running, "
            f"waiting starts {stuck}"
        )
        pool = self.sched.kv.pool
        assert pool.num_free_blocks == pool.num_blocks

    # -- invariants -----------------------------------------------------------------------------
    def check_blocks(self) -> None:
        """Exact block accounting: ref counts, the free queue and who holds what."""
        kv = self.sched.kv
        pool = kv.pool
        refs: Counter[int] = Counter()
        for request in self.all_requests:
            block_ids = kv.block_ids(request.request_id)
            assert len(set(block_ids)) == len(block_ids), f"{request} holds a block twice"
            assert bool(block_ids) == self.should_hold(request), f"{request} holds {block_ids}"
            refs.update(block_ids)
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id], f"{block}: {refs[block.block_id]} holders"
            if block.block_hash is not None:
                assert pool.lookup(block.block_hash, block.token_ids) is block
        free = list(pool.free_queue)
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert set(free) == {block for block in pool.blocks if block.ref_cnt == 0}
        assert len(refs) + pool.num_free_blocks == pool.num_blocks
        self.check_queues()

    def should_hold(self, request: Request) -> bool:
        """Running and awaiting requests hold blocks; a waiting one only after its KV landed."""
        status = request.status
        if status in (RequestStatus.RUNNING, RequestStatus.AWAITING_KV):
            return True
        return status == RequestStatus.WAITING and request.num_computed_tokens > 0

    def check_queues(self) -> None:
        """Every unfinished request sits in exactly the queue its status names."""
        sched, kv = self.sched, self.sched.kv
        waiting, running, awaiting = list(sched.waiting), sched.running, sched.awaiting_kv
        assert len(waiting) + len(running) + len(awaiting) == len(sched.requests)
        for request in sched.requests.values():
            in_queue = {
                RequestStatus.RUNNING: request in running,
                RequestStatus.AWAITING_KV: request.request_id in awaiting,
                RequestStatus.WAITING: request in waiting,
                RequestStatus.PREEMPTED: request in waiting,
            }[request.status]
            assert in_queue, f"{request} is not in its queue"
            if request.status == RequestStatus.RUNNING:
                assert kv.num_blocks_of(request.request_id) >= cdiv(request.num_computed_tokens, kv.block_size)
        assert len(running) <= sched.config.max_num_seqs


def run_sim(seed: int, num_events: int = NUM_EVENTS) -> Sim:
    sim = Sim(seed)
    for _ in range(num_events):
        sim.random_event()
        sim.check_blocks()
    sim.drain()
    return sim


@pytest.mark.parametrize("seed", seeds(NUM_SEEDS))
def test_random_events_keep_blocks_exact_and_every_request_finishes(seed: int):
    run_sim(seed)


def test_the_simulation_exercises_every_path():
    """Guard against a sim that quietly stops reaching preemption, transfers or prefix hits."""
    sims = [run_sim(seed) for seed in range(10)]
    stats = [s.sched.stats for s in sims]
    assert sum(s.num_preemptions for s in stats) > 0
    assert sum(s.prefix_cache_hits for s in stats) > 0
    assert sum(s.num_landed for s in sims) > 0
