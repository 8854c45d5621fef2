"""Prefix index: which worker holds which KV blocks (in memory by default, or in Redis)."""

from splitserve.gateway.kv_index import memory as _memory  # noqa: F401  registers "memory"
from splitserve.gateway.kv_index import redis_index as _redis  # noqa: F401  registers "redis"
from splitserve.gateway.kv_index.base import (
    ApplyResult,
    EventBatch,
    IndexUnavailable,
    KVIndex,
    index_backends,
    make_index,
)

__all__ = ["ApplyResult", "EventBatch", "IndexUnavailable", "KVIndex", "index_backends", "make_index"]
