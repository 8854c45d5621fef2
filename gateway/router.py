"""Routers pick a worker for a request. The prefix-index issue adds a KV-aware router here."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from splitserve.gateway.workers import WorkerHandle


class Router(ABC):
    name: str

    @abstractmethod
    def pick(self, workers: Sequence[WorkerHandle], prompt_token_ids: Sequence[int]) -> WorkerHandle | None:
        """The worker for this request among healthy candidates, or None when there are none."""


class LeastOutstandingRouter(Router):
    """Fewest requests in flight from this gateway, then shortest reported queue; ties rotate."""

    name = "least-outstanding"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, workers, prompt_token_ids):
        if not workers:
            return None
        offset = next(self._turn) % len(workers)
        rotated = list(workers[offset:]) + list(workers[:offset])
        return min(rotated, key=lambda w: (w.outstanding, w.load.num_waiting))


ROUTERS: dict[str, type[Router]] = {LeastOutstandingRouter.name: LeastOutstandingRouter}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; available: {sorted(ROUTERS)}")
    return ROUTERS[name]()
