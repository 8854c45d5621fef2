"""Model loading errors name the problem; GGUF Q/K un-permutation matches transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from splitserve.common.model_files import ModelLoadError
from splitserve.services.model.gguf_loader import _unpermute
from splitserve.services.model.loader import open_model


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_model(tmp_path / "nope")


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        open_model(tmp_path)


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPTNeoX"):
        open_model(folder)


def test_missing_weights(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        open_model(folder)


def test_shape_mismatch_names_the_tensor(tiny_llama_dir, tmp_path):
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.engine import Engine

    folder = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape mismatch for 'model.layers.0.mlp"):
        Engine(EngineConfig(model=str(folder)))


def test_not_gguf_file(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        open_model(bad)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not really gguf")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_model(fake)


def test_unpermute_inverts_llama_cpp_permute():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # llama.cpp's converter: reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute(permuted, heads), w)
