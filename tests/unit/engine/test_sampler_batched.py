"""The batched sampler against the per-row reference it replaced (sampling_ops.sample_tokens_ref).

Token for token over random mixed batches (greedy, seeded, unseeded from the same shared seed,
every filter and penalty, min_tokens), over several steps; plus a seeded stream continued by another
Sampler from its tokens alone (the draws keyed by seed and position), and a failing request left out.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from suites import examples

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.request import Request, RequestId
from splitserve.services.engine.sampler import Sampler, _blocked_token_ids, _filtered_probs, _penalised, _Plan
from splitserve.services.engine.sampling_ops import (
    RefGenerators,
    apply_penalties_ref,
    apply_top_p_min_p,
    block_stop_tokens_ref,
    filtered_probs_ref,
    noise_seed,
    sample_tokens_ref,
)

EOS = 3
SHARED_SEED = 99


def make_request(rid: str, params: SamplingParams, prompt: list[int]) -> Request:
    return Request(RequestId(rid), prompt, params, max_tokens=100, eos_token_ids=frozenset({EOS}), block_size=4)


def params_strategy(vocab: int) -> st.SearchStrategy[SamplingParams]:
    return st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.7]),
        top_k=st.sampled_from([None, 1, 2, 5, vocab // 2, vocab, vocab + 3]),
        top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 1e-6]),
        min_p=st.sampled_from([0.0, 0.02, 0.3]),
        seed=st.sampled_from([None, None, 0, 1, 7, 2**40]),
        repetition_penalty=st.sampled_from([1.0, 1.0, 0.8, 1.3, 2.0]),
        presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=st.sampled_from([0.0, 0.0, 0.4, 1.5, -0.3]),
        min_tokens=st.sampled_from([0, 0, 2, 4]),
        max_tokens=st.just(50),
        stop_token_ids=st.sampled_from([(), (4,), (4, 9, 4)]),
        ignore_eos=st.booleans(),
        logprobs=st.sampled_from([None, None, 0, 3]),
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[Request], int]:
    vocab = draw(st.sampled_from([16, 64, 320]))
    params = draw(st.lists(params_strategy(vocab), min_size=1, max_size=12))
    requests = []
    for i, p in enumerate(params):
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
        requests.append(make_request(f"r{i}", p, prompt))
    num_steps = draw(st.integers(1, 5))
    logits_seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))  # flat to peaked distributions
    gen = torch.Generator().manual_seed(logits_seed)
    return torch.randn(num_steps, len(requests), vocab, generator=gen) * scale, requests, vocab


@settings(max_examples=examples(300), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_batched_sampler_equals_the_per_row_reference(batch):
    steps, requests, _ = batch
    sampler, ref_generators = Sampler(seed=SHARED_SEED), RefGenerators(SHARED_SEED)
    for logits in steps:
        result = sampler.sample(logits, requests)
        assert not result.errors
        assert result.token_ids == sample_tokens_ref(logits, requests, ref_generators)
        for request, token in zip(requests, result.token_ids):
            assert token is not None
            request.append_output_token(token)


@settings(max_examples=examples(200), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_processed_logits_and_probabilities_are_bit_identical(batch):
    # Stronger than equal tokens: a one-ulp difference rarely changes a token, but shows here.
    steps, requests, vocab = batch
    for request in requests:  # some output, so that presence/frequency and min_tokens have work
        for token in (1, 1, EOS % vocab, 7):
            request.append_output_token(token)
    plan = _Plan()
    for request in requests:
        plan.add(request, _blocked_token_ids(request, vocab))
    logits = steps[0]
    processed = _penalised(logits, plan, list(range(len(requests))))
    reference = logits.clone()
    for row, request in enumerate(requests):
        apply_penalties_ref(reference[row], request)
        block_stop_tokens_ref(reference[row], request)
    assert torch.equal(processed, reference)
    sampled = [row for row, r in enumerate(requests) if not r.sampling_params.greedy]
    if sampled:
        probs = _filtered_probs(processed[sampled], [requests[row].sampling_params for row in sampled])
        for i, row in enumerate(sampled):
            p = requests[row].sampling_params
            expected = filtered_probs_ref(reference[row] / p.temperature, p.top_k, p.top_p, p.min_p)
            assert torch.equal(probs[i], expected)


@pytest.mark.parametrize("num_candidates", [1, 4, 32, 10_000])
def test_top_p_among_candidates_equals_the_whole_sort(num_candidates):
    # Peaked rows are decided among a few candidates, flat ones (or too few candidates) sort all.
    vocab, num_rows = 300, 20
    scales = torch.tensor([0.5, 2.0, 5.0, 10.0, 30.0]).repeat(4)[:, None]
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(3)) * scales
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.3, 0.75]).repeat(4)
    min_p = torch.tensor([0.0, 0.0, 0.01, 0.2]).repeat(5)
    rows = torch.arange(0, num_rows, 2)  # every other row has a top-p
    probs = torch.softmax(logits, dim=-1)
    apply_top_p_min_p(probs, rows, top_p[rows], min_p, num_candidates)
    for row in range(num_rows):
        p = float(top_p[row]) if row % 2 == 0 else 1.0
        assert torch.equal(probs[row], filtered_probs_ref(logits[row], None, p, float(min_p[row]))), row


def test_equal_at_a_real_vocabulary_size():
    vocab, gen = 49152, torch.Generator().manual_seed(0)
    all_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, seed=3, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=11, repetition_penalty=1.2),
        SamplingParams(temperature=1.2, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    requests = [make_request(f"r{i}", p, [5, 6, 7, 5, 100, 40000]) for i, p in enumerate(all_params)]
    sampler, ref_generators = Sampler(seed=SHARED_SEED), RefGenerators(SHARED_SEED)
    for _ in range(4):
        logits = torch.randn(len(requests), vocab, generator=gen) * 2
        tokens = sampler.sample(logits, requests).token_ids
        assert tokens == sample_tokens_ref(logits, requests, ref_generators)
        assert tokens[0] == int(logits[0].argmax())
        for request, token in zip(requests, tokens):
            request.append_output_token(token)


def _flat_logits(num_steps: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(num_steps, 1, vocab, generator=torch.Generator().manual_seed(5)) * 0.3


def test_noise_seed_is_splitmix64_of_seed_and_position():
    # Pinned: every worker (any process, any version) must key the same token's draw the same way.
    # noise_seed(0, 0) is SplitMix64's first output for state 0 (0xE220A8397B1DCDAF).
    assert noise_seed(0, 0) == 0xE220A8397B1DCDAF
    assert noise_seed(1234, 7) == 4199148429166567583
    assert noise_seed(2**64 - 1, 5000) == 12922035877463709129  # the whole uint64 range
    assert len({noise_seed(seed, position) for seed in range(8) for position in range(64)}) == 8 * 64


def test_a_seeded_stream_continues_on_another_sampler_from_its_tokens_alone():
    # What a migrated stream relies on: the draw for a position depends on (seed, position) only, so
    # another sampler (another worker, another shared seed, other neighbours in the batch) given the
    # tokens so far samples the rest exactly. Penalties see the same output tokens.
    params = SamplingParams(temperature=1.0, seed=2**64 - 3, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.1)
    steps = _flat_logits(12)
    whole = Sampler(seed=0)
    one = make_request("r", params, [1, 2])
    expected = []
    for logits in steps:
        expected.append(whole.sample(logits, [one]).token_ids[0])
        one.append_output_token(expected[-1])

    elsewhere = Sampler(seed=1)
    moved = make_request("moved", params, [1, 2])
    for token in expected[:5]:
        moved.append_output_token(token)
    neighbour = make_request("n", SamplingParams(temperature=1.0, seed=9), [3])
    rest = []
    for logits in steps[5:]:
        rest.append(elsewhere.sample(torch.cat([logits, logits]), [neighbour, moved]).token_ids[1])
        moved.append_output_token(rest[-1])
    assert rest == expected[5:]
    assert len(set(expected)) > 1  # it really sampled


def test_a_failing_request_is_left_out_before_any_draw():
    vocab = 64
    good = [
        make_request("unseeded", SamplingParams(temperature=1.0, top_k=10), [1, 2]),
        make_request("seeded", SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.5), [1, 2]),
    ]
    bad = make_request("bad", SamplingParams(temperature=1.0, min_tokens=2), [1, 2])
    object.__setattr__(bad.sampling_params, "stop_token_ids", (vocab + 5,))  # as if never validated
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    with_bad = Sampler(seed=SHARED_SEED).sample(logits, [good[0], bad, good[1]])
    without = Sampler(seed=SHARED_SEED).sample(logits[[0, 2]], good)
    assert [r for r, _ in with_bad.errors] == [bad]
    assert isinstance(with_bad.errors[0][1], IndexError)
    assert with_bad.token_ids == [without.token_ids[0], None, without.token_ids[1]]
    assert with_bad.logprobs == [None, None, None]
