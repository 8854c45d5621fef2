"""The engine's per-step counters (services/engine/step_stats.py): known answers for a hand-built step, and the
totals of a tiny engine's steps (chunked prefill, a mixed step, decodes)."""

from __future__ import annotations

import numpy as np

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.step_stats import STEP_SECONDS_BUCKETS, StepKind, StepStats, StepTotals
from splitserve.services.planner.profile import decode_features, prefill_features


def _sums(t: StepTotals) -> tuple[int, ...]:
    return (t.num_steps, t.num_seqs, t.num_tokens, t.context_tokens, t.attention_tokens2)


def test_a_step_adds_the_sums_the_profile_features_are_made_of():
    stats = StepStats()
    # prefill: a whole prompt of 100, and the last 512 tokens of a 1024-token prompt
    starts, query_lens = np.array([0, 512]), np.array([100, 512])
    stats.record(starts, query_lens, 612, 0.25)
    # decode: 3 sequences at 10, 20, 30 tokens, one more each
    stats.record(np.array([10, 20, 30]), np.ones(3, dtype=np.int64), 3, 0.003)
    prefill, decode = stats.snapshot()[StepKind.PREFILL], stats.snapshot()[StepKind.DECODE]
    assert (1.0, prefill.num_tokens, prefill.attention_tokens2) == prefill_features([100, 512], [100, 1024])
    assert prefill.context_tokens == 100 + 1024 and prefill.num_seqs == 2 and prefill.seconds == 0.25
    assert (1.0, decode.num_seqs, decode.context_tokens) == decode_features(3, (11 + 21 + 31) / 3)
    assert decode.num_tokens == 3 and decode.attention_tokens2 == 0 and decode.seconds == 0.003
    # the histogram: 0.25 in the (0.1, 0.25] bucket, 0.003 in (0.001, 0.005]
    assert prefill.bucket_counts[STEP_SECONDS_BUCKETS.index(0.25)] == 1 and sum(prefill.bucket_counts) == 1
    assert decode.bucket_counts[STEP_SECONDS_BUCKETS.index(0.005)] == 1 and sum(decode.bucket_counts) == 1


def test_a_snapshot_does_not_move_with_later_steps():
    stats = StepStats()
    before = stats.snapshot()
    stats.record(np.array([4]), np.array([1]), 1, 100.0)  # beyond the largest bound: the +Inf bucket
    assert before[StepKind.DECODE].num_steps == 0 and sum(before[StepKind.DECODE].bucket_counts) == 0
    assert stats.decode.bucket_counts[-1] == 1


def test_the_engine_counts_every_step(tiny_llama_dir):
    """Prompts of 5 and 9 tokens, 4 output tokens each, a 12-token budget:
    step 1 (prefill): 5 tokens of A and the first 7 of B;  step 2 (prefill: B's last 2 and A's decode);
    steps 3-4 decode both, step 5 decodes B alone."""
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir),
            max_model_len=256,
            cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
        )
    )
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request([3, 4, 5, 6, 7], params)
        engine.add_request([10, 11, 12, 13, 14, 15, 16, 17, 18], params)
        while engine.has_unfinished_requests():
            engine.step()
        steps = engine.step_stats.snapshot()
    finally:
        engine.close()
    prefill, decode = steps[StepKind.PREFILL], steps[StepKind.DECODE]
    # steps, sequences, tokens, context after each step, seq_len^2 - start^2
    assert _sums(prefill) == (2, 2 + 2, 12 + 3, (5 + 7) + (6 + 9), (25 + 49) + (36 - 25) + (81 - 49))
    assert _sums(decode) == (3, 2 + 2 + 1, 5, (7 + 10) + (8 + 11) + 12, 0)
    for totals in (prefill, decode):
        assert totals.seconds > 0 and sum(totals.bucket_counts) == totals.num_steps
