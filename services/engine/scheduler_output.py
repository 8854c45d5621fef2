"""What a schedule decides for one step, and what the update after it changed.

Decodes (one new token that catches the request up, so it samples) are the whole batch at steady
state: they are kept as bare requests, with no per-request object built per step. Everything else
(prefill chunks, a one-token chunk that does not catch up) is a ScheduledRequest. Batch order,
which the runner relies on: decodes, then chunks with one-token chunks first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from splitserve.services.engine.kv_cache.block_pool import BlockId
from splitserve.services.engine.kv_cache.manager import KVCacheManager
from splitserve.services.engine.request import Request, RequestId


class ScheduledRequest:
    """One request's share of a step."""

    __slots__ = ("request", "num_new_tokens", "samples", "_kv", "_block_ids")

    def __init__(self, request: Request, num_new_tokens: int, samples: bool, kv: KVCacheManager) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens
        # Whether this step catches the request up, so a token is sampled for it. Fixed at schedule
        # time so it stays right after update_after_step moves num_computed_tokens.
        self.samples = samples
        self._kv = kv
        self._block_ids: list[BlockId] | None = None

    @property
    def block_ids(self) -> list[BlockId]:
        """The request's blocks when first read (for checks; the runner reads SchedulerOutput.block_table)."""
        if self._block_ids is None:
            self._block_ids = self._kv.block_ids(self.request.request_id)
        return self._block_ids


@dataclass(slots=True)
class SchedulerOutput:
    kv: KVCacheManager  # where ScheduledRequest.block_ids comes from
    decodes: list[Request] = field(default_factory=list)  # one new token each, each samples
    chunks: list[ScheduledRequest] = field(default_factory=list)  # the rest, one-token chunks first
    preempted: list[Request] = field(default_factory=list)
    # [num scheduled, most blocks of any] int64, batch order: each one's block ids, padded with 0
    block_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    _scheduled: list[ScheduledRequest] | None = None

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every scheduled request in batch order (built on first read; the step itself reads
        decodes and chunks)."""
        if self._scheduled is None:
            self._scheduled = [ScheduledRequest(r, 1, True, self.kv) for r in self.decodes] + self.chunks
        return self._scheduled

    def sampling_requests(self) -> list[Request]:
        """The requests that sample this step, in batch order (the logits' rows)."""
        return self.decodes + [s.request for s in self.chunks if s.samples]

    def request_ids(self) -> list[RequestId]:
        """Every scheduled request's id, in batch order."""
        return [r.request_id for r in self.decodes] + [s.request.request_id for s in self.chunks]

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.chunks


class StepUpdate(NamedTuple):
    """What update_after_step changed."""

    advanced: list[Request]  # got a new token this step (finished ones included), in batch order
    finished: list[Request]  # of those, the ones that finished
