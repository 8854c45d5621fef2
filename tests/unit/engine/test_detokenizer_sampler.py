"""Incremental detokenizer (real byte-level BPE: the bundled SmolLM2 tokenizer) and the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.detokenizer import IncrementalDetokenizer
from splitserve.services.engine.request import Request, RequestId
from splitserve.services.engine.sampler import Sampler, _Plan
from splitserve.services.engine.sampler import _penalised as penalised_batch
from splitserve.services.engine.sampling_ops import apply_penalties_ref, filtered_probs_ref

MULTI_BYTE_TEXTS = [
    "Hello 👋 world 🌍! 👩‍👩‍👧 done",
    "你好，世界。中文测试",
    "café naïve résumé Ångström — “quotes” ½ ∑",
    "mixed: emoji🎉中文é end",
]


@pytest.fixture(scope="module")
def tok():
    from splitserve.services.model.loader import open_model

    return open_model(None).tokenizer


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(tok, ids: list[int], params: SamplingParams) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed ids one at a time as the engine does; returns the streamed chunks and the matched stop."""
    detok = IncrementalDetokenizer(tok, params)
    chunks: list[str] = []
    matched = None
    for token_id in ids:
        matched = detok.add_tokens([token_id])
        chunks.append(detok.take_delta(finished=matched is not None))
        if matched is not None:
            break
    if matched is None:
        detok.flush()
        chunks.append(detok.take_delta(finished=True))
    return chunks, matched, detok


# -- IncrementalDetokenizer -----------------------------------------------------------------------


def test_texts_really_split_characters_across_tokens(tok):
    # Otherwise the streaming tests below would not exercise partial UTF-8 sequences.
    for text in MULTI_BYTE_TEXTS:
        pieces = [tok.decode([i]) for i in _encode(tok, text)]
        assert any("\ufffd" in p for p in pieces), text


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_streamed_chunks_concatenate_to_full_decode(tok, text):
    ids = _encode(tok, text)
    chunks, matched, detok = _stream(tok, ids, SamplingParams())
    assert matched is None
    assert "".join(chunks) == tok.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in c for c in chunks), chunks
    assert sum(1 for c in chunks if c) > 3  # really incremental, not all at the end


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_stream_with_unmatched_stop_strings_holds_back_then_releases(tok, text):
    ids = _encode(tok, text)
    chunks, matched, _ = _stream(tok, ids, SamplingParams(stop=["<never>", "zzzz"]))
    assert matched is None
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    assert len(chunks[-1]) >= len("<never>") - 1  # the held-back tail comes out only at the end


def test_several_tokens_at_once_give_the_same_text(tok):
    text = MULTI_BYTE_TEXTS[0]
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, SamplingParams())
    chunks = []
    for start in range(0, len(ids), 3):
        detok.add_tokens(ids[start : start + 3])
        chunks.append(detok.take_delta(finished=False))
    detok.flush()
    chunks.append(detok.take_delta(finished=True))
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)


def test_flush_releases_an_incomplete_character_at_the_end(tok):
    ids = _encode(tok, "a 👋")
    detok = IncrementalDetokenizer(tok, SamplingParams())
    detok.add_tokens(ids[:-1])  # the emoji's last byte is missing
    assert "\ufffd" not in detok.take_delta(finished=False)
    detok.flush()
    assert detok.take_delta(finished=True) == tok.decode(ids[:-1])[len("a") :]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_one_token(tok, include):
    ids = _encode(tok, "stop here END now")
    params = SamplingParams(stop=["EN"], include_stop_str_in_output=include)
    chunks, matched, detok = _stream(tok, ids, params)
    expected = "stop here EN" if include else "stop here "
    assert matched == "EN"
    assert detok.text == expected and "".join(chunks) == expected
    assert len(chunks) == 3  # stopped at the token " END"; " now" was never decoded
    assert detok.add_tokens(ids[3:]) is None and detok.text == expected


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("stop here END now", "re EN", "stop he"),  # " here" + " END"
        ("Hello 👋 world 🌍!", "👋 wor", "Hello "),  # an emoji of 3 tokens, then " world"
        ("你好，世界。中文测试", "界。中", "你好，世"),
    ],
)
def test_stop_string_spanning_tokens_is_never_partially_streamed(tok, include, text, stop, before):
    ids = _encode(tok, text)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, params)
    expected = before + stop if include else before
    streamed = ""
    matched = None
    for token_id in ids:
        matched = detok.add_tokens([token_id])
        streamed += detok.take_delta(finished=matched is not None)
        # Streamed text can never be taken back: it must always be a prefix of the final text.
        assert expected.startswith(streamed), (streamed, expected)
        if matched is not None:
            break
    assert matched == stop
    assert streamed == detok.text == expected


@pytest.mark.parametrize("stops", [["op", "st"], ["st", "op"]])
def test_earliest_stop_string_wins_whatever_the_list_order(tok, stops):
    # One token "stop" completes both; cutting at "op" would return "st", itself a stop string.
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=stops))
    assert detok.add_tokens(_encode(tok, "stop here")) == "st"
    assert detok.text == "" and detok.take_delta(finished=True) == ""


def test_without_stop_strings_text_is_not_held_back(tok):
    ids = _encode(tok, "stop here END now")
    detok = IncrementalDetokenizer(tok, SamplingParams())
    detok.add_tokens(ids[:2])
    assert detok.take_delta(finished=False) == "stop here"


def test_stop_strings_hold_back_their_length_minus_one(tok):
    ids = _encode(tok, "stop here END now")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["xyz"]))
    detok.add_tokens(ids[:2])
    assert detok.take_delta(finished=False) == "stop he"  # len("xyz") - 1 characters wait
    assert detok.take_delta(finished=True) == "re"


def test_special_tokens_are_skipped(tok):
    eos = min(tok.eos_token_ids)
    ids = _encode(tok, "hi there") + [eos]
    chunks, _, _ = _stream(tok, ids, SamplingParams())
    assert "".join(chunks) == "hi there"
    chunks, _, _ = _stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(chunks) == "hi there" + tok.id_to_token(eos)


# -- Sampler ----------------------------------------------------------------------------------------

VOCAB = 64
EOS = 3


def make_request(rid: str, params: SamplingParams, prompt: list[int] | None = None) -> Request:
    return Request(
        RequestId(rid),
        prompt or [10, 11, 12],
        params,
        max_tokens=params.max_tokens or 100,
        eos_token_ids=frozenset({EOS}),
        block_size=4,
    )


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = random_logits(5, 0)
    requests = [make_request(f"g{i}", SamplingParams(temperature=0.0)) for i in range(5)]
    result = Sampler(seed=0).sample(logits, requests)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 5


def test_greedy_row_in_a_mixed_batch_is_still_argmax():
    logits = random_logits(3, 1)
    requests = [
        make_request("r", SamplingParams(temperature=1.0)),
        make_request("g", SamplingParams(temperature=0.0)),
        make_request("s", SamplingParams(temperature=0.7, seed=5)),
    ]
    for _ in range(5):
        assert Sampler(seed=0).sample(logits, requests).token_ids[1] == int(logits[1].argmax())


def _seeded_run(batch_with_others: bool, seed: int = 1234, num_steps: int = 40) -> list[int]:
    """Tokens of one seeded request over num_steps; optionally batched among other requests."""
    sampler = Sampler(seed=99)
    target = make_request("target", SamplingParams(temperature=1.0, seed=seed))
    others = [
        make_request("unseeded", SamplingParams(temperature=1.0)),
        make_request("other-seed", SamplingParams(temperature=0.8, seed=7, top_k=10)),
    ]
    target_rows = random_logits(num_steps, 42) * 0.5  # flat enough that sampling is not argmax
    noise_rows = random_logits(num_steps * 2, 43)
    tokens = []
    for t in range(num_steps):
        if batch_with_others:
            # The target in the middle, with rows that consume random numbers before and after it.
            logits = torch.stack([noise_rows[2 * t], target_rows[t], noise_rows[2 * t + 1]])
            result = sampler.sample(logits, [others[0], target, others[1]])
            tokens.append(result.token_ids[1])
        else:
            tokens.append(sampler.sample(target_rows[t : t + 1], [target]).token_ids[0])
    return tokens


def test_seeded_request_is_independent_of_the_batch():
    alone = _seeded_run(batch_with_others=False)
    assert alone == _seeded_run(batch_with_others=True)
    assert alone == _seeded_run(batch_with_others=False)  # reproducible
    greedy = (random_logits(40, 42) * 0.5).argmax(dim=-1).tolist()
    assert alone != greedy  # it really sampled
    assert alone != _seeded_run(batch_with_others=False, seed=4321)  # the seed matters


def test_two_requests_with_the_same_seed_sample_the_same_tokens():
    sampler = Sampler(seed=0)
    a = make_request("a", SamplingParams(temperature=1.0, seed=5))
    b = make_request("b", SamplingParams(temperature=1.0, seed=5))
    rows = random_logits(20, 3) * 0.3
    for t in range(20):
        ta, tb = sampler.sample(torch.stack([rows[t], rows[t]]), [a, b]).token_ids
        assert ta == tb


def test_sampling_follows_the_distribution():
    # Two tokens with probabilities 0.8 / 0.2: the empirical rate must be close.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, 5], logits[0, 9] = math.log(0.8), math.log(0.2)
    sampler = Sampler(seed=0)
    request = make_request("r", SamplingParams(temperature=1.0))
    picks = [sampler.sample(logits, [request]).token_ids[0] for _ in range(2000)]
    assert set(picks) == {5, 9}
    assert 0.75 < picks.count(5) / len(picks) < 0.85


def test_top_k_1_equals_greedy():
    logits = random_logits(8, 4)
    sampler = Sampler(seed=0)
    requests = [make_request(f"k{i}", SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(8)]
    for _ in range(5):
        assert sampler.sample(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(8, 5) * 0.2
    sampler = Sampler(seed=0)
    requests = [make_request(f"p{i}", SamplingParams(temperature=1.0, top_p=1e-6)) for i in range(8)]
    for _ in range(5):
        assert sampler.sample(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_to_the_k_best():
    logits = random_logits(1, 6)
    best3 = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler(seed=0)
    request = make_request("r", SamplingParams(temperature=5.0, top_k=3))
    picks = {sampler.sample(logits, [request]).token_ids[0] for _ in range(200)}
    assert picks == best3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_token_ids(temperature):
    params = SamplingParams(temperature=temperature, min_tokens=3, max_tokens=10, stop_token_ids=[4])
    request = make_request("r", params)
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 1e4
    logits[0, 4] = 1e4 - 1
    logits[0, 8] = 100.0
    for _ in range(3):
        token = sampler.sample(logits.clone(), [request]).token_ids[0]
        assert token == 8
        request.append_output_token(token)
    assert request.num_output_tokens == 3
    assert sampler.sample(logits, [request]).token_ids == [EOS]


def test_ignore_eos_still_blocks_stop_tokens_but_not_eos():
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[4])
    request = make_request("r", params)
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 50.0
    logits[0, EOS] = 40.0
    assert Sampler(seed=0).sample(logits, [request]).token_ids == [EOS]


def _penalised(params: SamplingParams, row: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    request = make_request("r", params, prompt)
    for t in output:
        request.append_output_token(t)
    plan = _Plan()
    plan.add(request, [])
    batched = penalised_batch(row[None], plan, [0])[0]
    reference = row.clone()
    apply_penalties_ref(reference, request)
    assert torch.equal(batched, reference)
    return batched


def test_repetition_penalty_direction():
    row = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    out = _penalised(SamplingParams(repetition_penalty=2.0), row, prompt=[0, 1], output=[1])
    # Seen tokens (prompt and output) lose: positive logits halve, negative ones double.
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]
    out = _penalised(SamplingParams(repetition_penalty=0.5), row, prompt=[0, 1], output=[])
    assert out.tolist() == [4.0, -1.0, 2.0, -2.0, 1.0]  # < 1 encourages repeats


def test_presence_and_frequency_penalties_direction():
    row = torch.zeros(6)
    out = _penalised(SamplingParams(presence_penalty=0.5), row, prompt=[0, 5], output=[1, 2, 2])
    assert out.tolist() == [0.0, -0.5, -0.5, 0.0, 0.0, 0.0]  # output only, once per distinct token
    out = _penalised(SamplingParams(frequency_penalty=0.5), row, prompt=[0, 5], output=[1, 2, 2])
    assert out.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0, 0.0]  # proportional to the count
    out = _penalised(SamplingParams(presence_penalty=-1.0, frequency_penalty=1.0), row, [0], [2, 2])
    assert out.tolist() == [0.0, 0.0, -1.0, 0.0, 0.0, 0.0]


def test_penalties_change_the_greedy_choice_without_touching_the_input():
    logits = torch.zeros(2, VOCAB)
    logits[:, 20], logits[:, 21] = 5.0, 4.0
    original = logits.clone()
    plain = make_request("plain", SamplingParams(temperature=0.0))
    penalised = make_request("pen", SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[20])
    result = Sampler(seed=0).sample(logits, [plain, penalised])
    assert result.token_ids == [20, 21]
    assert torch.equal(logits, original)


def test_logprobs_top_n_sorted_and_sampled_token_logprob():
    logits = random_logits(2, 8)
    expected = torch.log_softmax(logits, dim=-1)
    requests = [
        make_request("lp", SamplingParams(temperature=1.0, seed=3, logprobs=5, repetition_penalty=1.5)),
        make_request("none", SamplingParams(temperature=1.0, seed=3)),
    ]
    result = Sampler(seed=0).sample(logits, requests)
    lp = result.logprobs[0]
    assert result.logprobs[1] is None
    assert lp.token_id == result.token_ids[0]
    assert lp.logprob == pytest.approx(float(expected[0, lp.token_id]), abs=1e-5)  # raw, pre-penalty
    assert len(lp.top) == 5
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True)
    assert [i for i, _ in lp.top] == torch.topk(expected[0], 5).indices.tolist()
    assert values == pytest.approx(torch.topk(expected[0], 5).values.tolist(), abs=1e-5)
    assert lp.top[0][1] >= lp.logprob


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(1, 9)
    result = Sampler(seed=0).sample(logits, [make_request("r", SamplingParams(temperature=0.0, logprobs=0))])
    (lp,) = result.logprobs
    assert lp.top == ()
    assert lp.token_id == int(logits[0].argmax())
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    from splitserve.services.engine.sampler import _filtered_probs

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert filtered_probs_ref(logits[0], None, 0.5, 0.0).tolist() == [0.5, 0.0, 0.0]
    request = make_request("r", SamplingParams(top_p=0.5))
    assert _filtered_probs(logits.clone(), [request.sampling_params]).tolist() == [[0.5, 0.0, 0.0]]
