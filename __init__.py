"""splitserve: disaggregated prefill/decode LLM serving.

    from splitserve import LLM, SamplingParams

The names below load on first use (PEP 562), so importing the gateway, which shares this package,
never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

MODULE_ATTRS = {
    "LLM": "splitserve.services.engine.llm",
    "SamplingParams": "splitserve.common.sampling_params",
    "EngineConfig": "splitserve.services.engine.config",
}
__all__ = ["LLM", "SamplingParams", "EngineConfig"]

if TYPE_CHECKING:
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.llm import LLM


def __getattr__(name: str) -> Any:
    module = MODULE_ATTRS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
