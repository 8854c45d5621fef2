"""Property-based fuzzing of the public Generate API through a real gateway, on a unified worker and
on 1P1D: every field of GenerateRequest at its boundaries (non-finite floats, uint32/uint64 ends, odd
Unicode, huge strings and repeated fields, reused request ids, some while the same id is in flight).

Property: every call ends OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED within its deadline (never
UNKNOWN, INTERNAL, UNAVAILABLE or a hang), an OK stream echoes the client's request id and ends with
a finish reason, and afterwards a plain greedy request still returns the reference tokens.
No shrinking: the system under test is a set of processes whose state an example may change.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import engine_argv, greedy_request, stub, tokens, write_chat_model
from conftest import VOCAB_SIZE
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

MODEL = "tiny-llama-chat"
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
DEADLINE_S = 30.0
REFERENCE = greedy_request([3, 1, 4, 1, 5, 9, 2, 6], 8)

# -- values -------------------------------------------------------------------------------------------

UINT32 = st.one_of(st.sampled_from([0, 1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
UINT64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
INT32 = st.one_of(st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
WILD_FLOAT = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-45, 1e-6, -1.0, 2.0001, 1e39]), st.floats(width=32)
)
ODD = [
    "",
    "\x00",
    "a\x00b",
    "e\u0301\u0302\u0303\u0304" * 20,
    "\u202eevil\u202c",
    "\u05e9\u05dc\u05d5\u05dd",
    "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466\U0001f3f3\ufe0f\u200d\U0001f308",
    "\ufeff\u200b\u2028",
    "\U0010ffff",
    "the quick brown fox",
    "x" * 5000,
]
ODD_STRINGS = st.sampled_from(ODD)
TEXT = st.one_of(ODD_STRINGS, st.text(st.characters(exclude_categories=("Cs",)), max_size=40))
PROMPT_TEXT = st.one_of(
    st.sampled_from(ODD[1:]), st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
)
IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)
ROLES = st.sampled_from(["system", "user", "assistant"])
BAD_ROLES = st.sampled_from(["tool", "ghost"])  # the template rejects them (test_gateway_limits.CHAT_TEMPLATE)


def _chat(roles, min_size: int = 0) -> st.SearchStrategy[pb.ChatMessages]:
    message = st.builds(pb.ChatMessage, role=roles, content=TEXT)
    return st.lists(message, min_size=min_size, max_size=4).map(lambda m: pb.ChatMessages(messages=m))


def _prompt(kind: str, value) -> dict:
    return {} if kind == "none" else {kind: pb.TokenIds(ids=value) if kind == "token_ids" else value}


# Each field: (a value a careful client sends, a wild one). An example makes a few fields wild.
FIELDS = {
    "model": (st.sampled_from(["", MODEL]), st.sampled_from(["gpt-9", "m" * 10_000, "\x00", MODEL + " "])),
    "request_id": (
        st.sampled_from(["", "dup", "dup", "other", "\x00id", "\u00e9" * 10, "\U0001f642"]),
        st.one_of(st.just("r" * 257), TEXT),
    ),
    "priority": (INT32, INT32),
    "logprobs": (st.sampled_from([None, None, 0, 1, 5, 20]), st.one_of(st.just(21), UINT32)),
    "temperature": (st.sampled_from([None, 0.0, 0.0, 0.7, 1.0, 1e-6]), WILD_FLOAT),
    "top_p": (st.sampled_from([None, 0.1, 0.9, 1.0]), WILD_FLOAT),
    "top_k": (st.sampled_from([0, 1, 5, VOCAB_SIZE - 1, VOCAB_SIZE, 2**32 - 1]), UINT32),
    "min_p": (st.sampled_from([0.0, 0.05, 1.0]), WILD_FLOAT),
    "seed": (st.one_of(st.none(), UINT64), UINT64),
    "repetition_penalty": (st.sampled_from([None, 1.0, 1.3, 0.5]), WILD_FLOAT),
    "presence_penalty": (st.sampled_from([0.0, 0.5, 2.0, -2.0]), WILD_FLOAT),
    "frequency_penalty": (st.sampled_from([0.0, 0.5, 2.0, -2.0]), WILD_FLOAT),
    "max_tokens": (st.sampled_from([1, 2, 4, 8, 16]), st.one_of(st.none(), UINT32)),  # None: to the context's end
    "min_tokens": (st.sampled_from([0, 0, 1]), UINT32),
    "stop": (st.lists(TEXT, max_size=3), st.sampled_from([["s" * 1025], ["s"] * 257, ["s" * 1000] * 17])),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4),
        st.one_of(st.lists(UINT32, min_size=1, max_size=4), st.just([1] * 257)),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "prompt": (
        st.one_of(
            st.tuples(st.just("text"), PROMPT_TEXT),
            st.tuples(st.just("token_ids"), IDS),
            st.tuples(st.just("chat"), _chat(ROLES, min_size=1)),
        ),
        st.one_of(
            st.tuples(st.just("none"), st.none()),
            st.tuples(st.just("text"), st.sampled_from(["x" * ((1 << 20) + 1), "ab " * 60_000])),
            st.tuples(
                st.just("token_ids"),
                st.one_of(
                    st.lists(UINT32, max_size=40), st.sampled_from([[1] * 300, [5] * 100_000, [1 << 21] * 1_100_000])
                ),
            ),  # the last: over gRPC's 4 MiB
            st.tuples(st.just("chat"), _chat(st.one_of(BAD_ROLES, ODD_STRINGS))),
        ),
    ),
}
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
STOPPING_FIELDS = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos")


@st.composite
def requests(draw) -> pb.GenerateRequest:
    wild = set(draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)))
    v = {name: draw(strategies[name in wild]) for name, strategies in FIELDS.items()}

    def given_(names):
        return {n: v[n] for n in names if v[n] is not None}

    return pb.GenerateRequest(
        model=v["model"],
        request_id=v["request_id"],
        priority=v["priority"],
        logprobs=v["logprobs"],
        sampling=pb.SamplingParameters(**given_(SAMPLING_FIELDS)),
        stopping=pb.StoppingCriteria(**given_(STOPPING_FIELDS)),
        **_prompt(*v["prompt"]),
    )


# -- the property ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    return write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("fuzz") / MODEL)


@pytest.fixture(scope="module", params=["unified", "1p1d"])
def gateway(request, chat_model_dir):
    shape = dict(num_workers=1) if request.param == "unified" else dict(num_workers=0, num_prefill=1, num_decode=1)
    children = start_cluster(engine_argv=engine_argv(chat_model_dir), **shape)
    try:
        reference = tokens(stub(children[0].address), REFERENCE)
        assert len(reference) == 8
        yield children[0].address, reference
    finally:
        stop_cluster(children)


def _call(address: str, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    """(final status, what went wrong with an OK stream or the error details)."""
    try:
        chunks = list(stub(address).Generate(request, timeout=DEADLINE_S))
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    ids = {c.request_id for c in chunks}
    if ids != {request.request_id or chunks[0].request_id} or "" in ids:
        return grpc.StatusCode.OK, f"request ids {ids} in the stream"
    if chunks[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return grpc.StatusCode.OK, "no finish reason on the last chunk"
    return grpc.StatusCode.OK, ""


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def test_fuzzed_requests_end_ok_or_as_client_errors(gateway, batch):
    address, reference = gateway
    with ThreadPoolExecutor(len(batch)) as pool:  # concurrent: reused ids are in flight together
        results = list(pool.map(lambda r: _call(address, r), batch))
    for code, detail in results:
        event(code.name)  # pytest --hypothesis-show-statistics: how many requests got through
        assert code in ALLOWED, f"{code.name}: {detail}"
        assert code != grpc.StatusCode.OK or not detail, detail
    assert tokens(stub(address), REFERENCE) == reference
