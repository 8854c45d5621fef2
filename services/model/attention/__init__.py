"""Attention backends behind one interface, chosen by name from a registry."""

from splitserve.services.model.attention import torch_backend as _torch_backend  # noqa: F401  registers "torch"

# Registers "triton" without importing triton: without the package, only asking for it fails (clearly).
from splitserve.services.model.attention import triton_backend as _triton_backend  # noqa: F401
from splitserve.services.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    available_backends,
    default_backend_name,
    get_backend,
    register_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_backends",
    "default_backend_name",
    "get_backend",
    "register_backend",
]
