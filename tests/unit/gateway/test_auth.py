"""API keys, per-key limits and the access guard's decisions (gateway/auth.py, common/security.py).

The end-to-end checks on real processes with real certificates are in tests/integration/test_security.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.common.security import JOIN_SECRET_HEADER, ClusterSecurity, read_secret
from splitserve.gateway.auth import API_KEYS_ENV, RETRY_AFTER_KEY, ApiKeys, KeyLimiter, KeyPolicy, PublicAccess


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_key_file_lines_comments_and_per_key_overrides(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-a name=alice rps=2 burst=4\n\nsk-b  # no options\nsk-c concurrency=1\n")
    keys = ApiKeys.load(str(path), KeyPolicy(rps=10, concurrency=8))
    assert keys is not None and len(keys) == 3
    alice = keys.lookup(bearer("sk-a"))
    assert alice == KeyPolicy(name="alice", rps=2, burst=4, concurrency=8)
    assert keys.lookup(bearer("sk-b")) == KeyPolicy(name="key-4", rps=10, concurrency=8)
    assert keys.lookup(bearer("sk-c")).concurrency == 1
    assert keys.lookup(bearer("sk-d")) is None
    assert keys.lookup((("authorization", "sk-a"),)) is None  # not a bearer token
    assert keys.lookup(()) is None


def test_key_file_errors_are_readable(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a colour=blue\n")
    with pytest.raises(ValueError, match="unknown option"):
        ApiKeys.load(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no API key"):
        ApiKeys.load(str(path))


def test_keys_from_the_environment_and_none_means_open(monkeypatch):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert ApiKeys.load(None) is None
    monkeypatch.setenv(API_KEYS_ENV, "sk-1, sk-2")
    keys = ApiKeys.load(None)
    assert keys is not None and keys.lookup(bearer("sk-2")) is not None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_trips_and_refills():
    clock = Clock()
    limiter = KeyLimiter(clock)
    policy = KeyPolicy(name="k", rps=2.0, burst=3)
    for _ in range(3):  # the burst
        assert limiter.try_acquire(policy) is None
        limiter.release(policy)
    refusal = limiter.try_acquire(policy)
    assert refusal is not None and refusal.limit == "rate" and refusal.wait_s == pytest.approx(0.5)
    clock.now += 0.5  # one token back
    assert limiter.try_acquire(policy) is None
    assert limiter.try_acquire(policy) is not None
    clock.now += 10  # refills up to the burst, not beyond
    assert [limiter.try_acquire(policy) is None for _ in range(4)] == [True, True, True, False]


def test_concurrency_cap_counts_calls_in_flight_per_key():
    limiter = KeyLimiter(Clock())
    one, other = KeyPolicy(name="one", concurrency=2), KeyPolicy(name="other", concurrency=2)
    assert limiter.try_acquire(one) is None and limiter.try_acquire(one) is None
    assert limiter.try_acquire(one).limit == "concurrency"
    assert limiter.try_acquire(other) is None  # keys do not share a cap
    limiter.release(one)
    assert limiter.try_acquire(one) is None
    assert limiter.in_flight("one") == 2


def test_public_access_answers_unauthenticated_and_resource_exhausted_with_retry_after(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, "sk-ok")
    keys = ApiKeys.load(None, KeyPolicy(rps=1.0))
    access = PublicAccess(keys, KeyLimiter(Clock()))
    missing = asyncio.run(access(()))
    assert missing.denial[0] is grpc.StatusCode.UNAUTHENTICATED and "Bearer" in missing.denial[1]
    wrong = asyncio.run(access(bearer("sk-no")))
    assert wrong.denial[0] is grpc.StatusCode.UNAUTHENTICATED
    first = asyncio.run(access(bearer("sk-ok")))
    assert first.denial is None and first.release is not None
    first.release()
    second = asyncio.run(access(bearer("sk-ok")))
    assert second.denial[0] is grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in second.denial[1]
    assert dict(second.trailing)[RETRY_AFTER_KEY] == "1"


def test_join_secret_is_compared_whole(tmp_path, monkeypatch):
    cluster = ClusterSecurity(join_secret="s3cret")
    assert cluster.admits(((JOIN_SECRET_HEADER, "s3cret"),))
    assert not cluster.admits(((JOIN_SECRET_HEADER, "s3cre"),))
    assert not cluster.admits(())
    assert ClusterSecurity().admits(())  # no secret configured: open
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv("SPLITSERVE_JOIN_SECRET", "from-env")
    assert read_secret(str(path), "SPLITSERVE_JOIN_SECRET") == "from-file"
    assert read_secret(None, "SPLITSERVE_JOIN_SECRET") == "from-env"


def test_cluster_certificate_needs_its_ca():
    from splitserve.common.security import TlsIdentity

    with pytest.raises(ValueError, match="--cluster-ca"):
        ClusterSecurity(identity=TlsIdentity(b"cert", b"key"))
