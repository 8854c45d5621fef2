"""API keys and per-key limits for the public Generation API.

A caller sends `authorization: Bearer <key>`. Keys come from a file (--api-key-file: one key per
line, `#` starts a comment, optional `name=`, `rps=`, `burst=`, `concurrency=` after the key) or
from SPLITSERVE_API_KEYS (comma-separated); never from a command-line value. Only SHA-256 digests
of the keys are kept in memory. With no keys configured the API is open.

Each key has a token bucket (rps, burst) and a cap on generations in flight; a call over either ends
in RESOURCE_EXHAUSTED with `retry-after` (whole seconds, as in HTTP) in its trailing metadata.
Both count generations: a call takes one slot and one token when admitted (a gRPC Generate is one
generation), and an HTTP call that runs more (prompts x n) takes the rest once its body is read
(KeyGrant.extend_to); one that could never fit the key's limits is refused as INVALID_ARGUMENT.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import grpc

from splitserve.common.security import Admission, Metadata

API_KEYS_ENV = "SPLITSERVE_API_KEYS"
RETRY_AFTER_KEY = "retry-after"
_UNAUTHENTICATED = (
    "a valid API key is required: send `authorization: Bearer <key>` (gRPC metadata or HTTP header; "
    "`splitserve generate` and `bench` read SPLITSERVE_API_KEY)"
)


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What one key may do. 0 means unlimited."""

    name: str = "default"
    rps: float = 0.0  # sustained calls per second
    burst: int = 0  # calls allowed at once above the sustained rate (0: max(1, rps))
    concurrency: int = 0  # calls in flight

    def __post_init__(self) -> None:
        if self.rps < 0 or self.burst < 0 or self.concurrency < 0:
            raise ValueError(f"key {self.name!r}: rps, burst and concurrency must be >= 0")

    @property
    def bucket_size(self) -> float:
        return float(self.burst or max(1.0, self.rps))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_line(line: str, default: KeyPolicy, number: int) -> tuple[str, KeyPolicy] | None:
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    key, options = fields[0], dict(f.split("=", 1) for f in fields[1:] if "=" in f)
    unknown = set(options) - {"name", "rps", "burst", "concurrency"} or {f for f in fields[1:] if "=" not in f}
    if unknown:
        raise ValueError(
            f"API key line {number}: unknown option(s) {sorted(unknown)}; use name=, rps=, burst=, concurrency="
        )
    policy = replace(
        default,
        name=options.get("name", f"key-{number}"),
        rps=float(options.get("rps", default.rps)),
        burst=int(options.get("burst", default.burst)),
        concurrency=int(options.get("concurrency", default.concurrency)),
    )
    return key, policy


class ApiKeys:
    """Key digest -> policy."""

    def __init__(self, policies: dict[bytes, KeyPolicy]) -> None:
        self._policies = policies

    @classmethod
    def load(cls, path: str | None, default: KeyPolicy = KeyPolicy()) -> ApiKeys | None:
        """From the file, else SPLITSERVE_API_KEYS; None when neither names a key (an open API)."""
        if path:
            lines = Path(path).read_text().splitlines()
        else:
            lines = [k for k in os.environ.get(API_KEYS_ENV, "").split(",")]
        parsed = [_parse_line(line, default, i) for i, line in enumerate(lines, 1)]
        policies = {_digest(key): policy for key, policy in filter(None, parsed)}
        if path and not policies:
            raise ValueError(f"{path} holds no API key (one per line)")
        return cls(policies) if policies else None

    def __len__(self) -> int:
        return len(self._policies)

    def lookup(self, metadata: Metadata) -> KeyPolicy | None:
        header = dict(metadata).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._policies.get(_digest(token.strip()))


class Refusal(NamedTuple):
    limit: str  # "concurrency" or "rate"
    wait_s: float  # when to try again


class KeyLimiter:
    """Token buckets and in-flight counts, by key name. Single-threaded (the gateway's event loop)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}  # name -> (tokens, when)
        self._in_flight: dict[str, int] = {}

    def try_acquire(self, policy: KeyPolicy, count: int = 1) -> Refusal | None:
        """None if count generations may start (they then hold count slots until release), else why not."""
        if policy.concurrency and self._in_flight.get(policy.name, 0) + count > policy.concurrency:
            return Refusal("concurrency", 1.0)
        if policy.rps:
            now = self.clock()
            tokens, when = self._tokens.get(policy.name, (policy.bucket_size, now))
            tokens = min(policy.bucket_size, tokens + (now - when) * policy.rps)
            if tokens < count:
                self._tokens[policy.name] = (tokens, now)
                return Refusal("rate", (count - tokens) / policy.rps)
            self._tokens[policy.name] = (tokens - count, now)
        self._in_flight[policy.name] = self._in_flight.get(policy.name, 0) + count
        return None

    def release(self, policy: KeyPolicy, count: int = 1) -> None:
        self._in_flight[policy.name] -= count

    def refund(self, policy: KeyPolicy, count: int) -> None:
        """Gives back count rate tokens of a call refused after its admission (it ran nothing)."""
        if policy.name in self._tokens:
            tokens, when = self._tokens[policy.name]
            self._tokens[policy.name] = (min(policy.bucket_size, tokens + count), when)

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)


class KeyDenied(Exception):
    """A call its key may not make now (RESOURCE_EXHAUSTED, with retry-after) or ever (INVALID_ARGUMENT,
    UNAUTHENTICATED)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: Metadata = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class KeyGrant:
    """An admitted call's hold on its key's limits: one generation's slot and token at first. Released
    once, when the call ends however it ends."""

    def __init__(self, limiter: KeyLimiter, policy: KeyPolicy) -> None:
        self.limiter, self.policy = limiter, policy
        self.num_held = 1

    def extend_to(self, num_generations: int) -> None:
        """Holds num_generations in all, or raises KeyDenied (holding what it held)."""
        if num_generations <= self.num_held:
            return
        try:
            self._try_extend_to(num_generations)
        except KeyDenied:
            self.limiter.refund(self.policy, self.num_held)  # refused as a whole: a refusal costs no token
            raise
        self.num_held = num_generations

    def _try_extend_to(self, num_generations: int) -> None:
        policy = self.policy
        if (policy.concurrency and num_generations > policy.concurrency) or (
            policy.rps and num_generations > policy.bucket_size
        ):
            raise KeyDenied(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this call runs {num_generations} generations (prompts x n), more than API key "
                f"{policy.name!r} may ever run at once ({_limits(policy)}); send fewer prompts or a smaller n",
            )
        refusal = self.limiter.try_acquire(policy, num_generations - self.num_held)
        if refusal is not None:
            raise _over_limit(policy, refusal)

    def release(self) -> None:
        self.limiter.release(self.policy, self.num_held)
        self.num_held = 0


class PublicAccess:
    """The gateway's check for public calls (common.security.AccessGuard's public_check)."""

    def __init__(self, keys: ApiKeys, limiter: KeyLimiter | None = None) -> None:
        self.keys, self.limiter = keys, limiter or KeyLimiter()

    async def __call__(self, metadata: Metadata) -> Admission:
        try:
            grant = self.admit(metadata)
        except KeyDenied as e:
            return Admission(denial=(e.code, e.message), trailing=e.trailing)
        return Admission(release=grant.release)

    def admit(self, metadata: Metadata) -> KeyGrant:
        """The call's hold on one generation of its key's limits; raises KeyDenied."""
        policy = self.keys.lookup(metadata)
        if policy is None:
            raise KeyDenied(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        refusal = self.limiter.try_acquire(policy)
        if refusal is not None:
            raise _over_limit(policy, refusal)
        return KeyGrant(self.limiter, policy)


def _over_limit(policy: KeyPolicy, refusal: Refusal) -> KeyDenied:
    retry_after = max(1, math.ceil(refusal.wait_s))
    message = (
        f"API key {policy.name!r} is over its {refusal.limit} limit ({_limits(policy)}); retry after {retry_after} s"
    )
    return KeyDenied(grpc.StatusCode.RESOURCE_EXHAUSTED, message, ((RETRY_AFTER_KEY, str(retry_after)),))


def _limits(policy: KeyPolicy) -> str:
    return f"rps={policy.rps:g}, burst={policy.bucket_size:g}, concurrency={policy.concurrency or 'unlimited'}"
