"""The attention backend when Triton cannot run on a CUDA host: the default falls back to torch with one
logged line saying why (naming the Triton version); asking for triton by name is an error saying why.

No GPU here: check_supported never touches the device, so `torch.device("cuda")` is only a value.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch

from splitserve.services.model.attention import default_backend_name, get_backend, triton_backend
from splitserve.services.model.attention.torch_backend import TorchAttention

CUDA = torch.device("cuda", 0)


def _fallback_reason(caplog: pytest.LogCaptureFixture) -> str:
    """default_backend_name on CUDA picks torch and logs exactly one line; returns it."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitserve.services.model"):
        assert default_backend_name(CUDA) == "torch"
    (record,) = caplog.records
    assert record.getMessage().startswith("attention backend: torch, not triton: ")
    return record.getMessage()


@pytest.fixture
def old_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.1 as pytorch:2.5.1 images ship it: no triton.knobs."""
    fake = types.ModuleType("triton")
    fake.__version__ = "3.1.0"
    fake.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    monkeypatch.setitem(sys.modules, "triton", fake)


def test_old_triton_falls_back_to_torch_with_a_logged_reason(old_triton, caplog):
    reason = _fallback_reason(caplog)
    assert "triton 3.1.0 is too old" in reason and ">= 3.4" in reason
    assert get_backend(None, CUDA) is TorchAttention


def test_old_triton_asked_for_by_name_is_a_clear_error(old_triton):
    with pytest.raises(
        RuntimeError,
        match=r"--attention-backend triton cannot run: triton 3\.1\.0 is too old.*"
        r"Pass --attention-backend torch",
    ):
        get_backend("triton", CUDA)


def test_triton_that_does_not_import_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert "triton is installed but does not import" in _fallback_reason(caplog)


def test_no_triton_package_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: False)
    assert "needs the triton package" in _fallback_reason(caplog)


@pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed")
def test_no_c_compiler_falls_back(monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(triton_backend.shutil, "which", lambda name: None)
    assert "needs a C compiler" in _fallback_reason(caplog)
    with pytest.raises(RuntimeError, match="needs a C compiler"):
        get_backend("triton", CUDA)


@pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed")
def test_a_supported_triton_is_the_cuda_default(monkeypatch, caplog):
    monkeypatch.setenv("CC", "cc")
    with caplog.at_level(logging.WARNING, logger="splitserve.services.model"):
        assert default_backend_name(CUDA) == "triton"
    assert not caplog.records
