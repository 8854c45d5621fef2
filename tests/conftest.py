"""Shared fixtures: tiny random Llama/Qwen2 checkpoints written with transformers' save_pretrained."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The repository's root is the `splitserve` package (pyproject's package-dir): its folders are
# subpackages (splitserve.kernels, splitserve.services.engine, ...), never top-level modules. `python -m pytest`
# puts the working directory first on sys.path, where `kernels/` shadows Hugging Face's `kernels`
# package, which transformers 5.25 imports (and fails on ours): take the root off before anything
# imports transformers.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# Without CUDA the Triton kernel tests run under Triton's interpreter, which Triton reads when triton
# is first imported, and torch imports triton lazily (torch._dynamo, e.g. through transformers): so
# set it here, before any test or fixture runs. Importing torch alone does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB_SIZE = 320
# Where a test lives says what it is. tests/unit/<area>/ (the package it covers): in this process, in
# seconds; `pytest -m unit` (`make unit`) runs them, with fewer random cases (tests/suites.py). Their
# slow part, whole engines on the Triton interpreter and kernel grids past one case each, carries the
# marker `kernels` instead. tests/integration/: real processes (gateway and workers, redis-server,
# docker-compose) or the real bundled model. `make test` runs all three; every test is exactly one.
SUITES = frozenset({"unit", "kernels", "integration"})
_TESTS = Path(__file__).resolve().parent
_FOLDER_SUITE = {_TESTS / "unit": "unit", _TESTS / "integration": "integration"}


def pytest_configure(config: pytest.Config) -> None:
    import suites

    suites.configure(quick=config.option.markexpr == "unit")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so a test without its suite fails every run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        suite = next((s for folder, s in _FOLDER_SUITE.items() if folder in Path(item.path).parents), None)
        if suite == "unit" and item.get_closest_marker("kernels"):
            continue
        if suite is not None:
            item.add_marker(suite)
    wrong = [
        f"{item.nodeid}: {sorted(found) or 'none'}"
        for item in items
        if len(found := SUITES & {mark.name for mark in item.iter_markers()}) != 1
    ]
    if wrong:
        raise pytest.UsageError(
            "every test is in tests/unit/ (unit, or kernels) or tests/integration/, with no other suite's "
            "marker (see tests/conftest.py); these are not:\n  " + "\n  ".join(wrong)
        )


def _train_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [
        "the quick brown fox jumps over the lazy dog",
        "paged attention splits the cache into blocks",
        "prefill and decode run on separate workers",
    ] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))


def _save_tiny(folder: Path, architecture: str, **sizes: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common: dict = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(sizes)
    if architecture == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():  # random biases so the bias path is really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    _train_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def wide_llama_dir(tmp_path_factory) -> Path:
    """Random weights big enough that a 400-token prefill costs ~0.3 s on one core (the tiny model's
    prefill is cheaper than the gateway's work per request): for tests where compute must dominate."""
    sizes = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8)
    return _save_tiny(tmp_path_factory.mktemp("wide-llama"), "llama", **sizes)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
