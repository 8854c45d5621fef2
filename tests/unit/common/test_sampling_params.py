"""SamplingParams validation: bad values fail at construction with a message naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.common.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -5}, "max_tokens must be >= 1, got -5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": -0.1}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_k": 0}, "top_k must be >= 1 or None, got 0"),
        ({"top_k": -1}, "top_k must be >= 1 or None, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must not exceed max_tokens \(4\)"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
    ],
)
def test_bad_values_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("stop", [5, [1, 2], ["ok", 3], b"stop", {"a": 1}])
def test_unknown_stop_type_raises(stop):
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("ids", [[-1], ["a"], [True], "12", 7, [1.0]])
def test_bad_stop_token_ids_raise(ids):
    with pytest.raises(ValueError, match="stop_token_ids must be a list of non-negative ints"):
        SamplingParams(stop_token_ids=ids)


def test_boundary_values_are_accepted():
    SamplingParams(max_tokens=1, top_p=1.0, temperature=0.0, top_k=1, min_tokens=1)
    SamplingParams(top_p=1e-9, min_p=1.0, logprobs=0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(max_tokens=None, min_tokens=1000)  # no max: any min_tokens


def test_stop_is_normalised_to_a_tuple_of_non_empty_strings():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop="").stop == ()
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_params_are_frozen_and_flags_follow_values():
    params = SamplingParams(temperature=0.0)
    assert params.greedy and not params.has_penalties
    assert not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(frequency_penalty=0.1).has_penalties
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
