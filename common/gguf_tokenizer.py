"""Rebuild a GGUF file's byte-level BPE tokenizer with `tokenizers` (torch-free), cached on disk."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from splitserve.common.model_files import ModelLoadError, gguf_field, open_gguf
from splitserve.common.tokenizer import Tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> pre-tokenizer regexes, applied in order (as llama.cpp does).
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then the GPT-2 split
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}


def load_gguf_tokenizer(path: Path, reader=None) -> Tokenizer:
    """The tokenizer embedded in a GGUF file (vocab, merges, chat template, EOS)."""
    reader = reader if reader is not None else open_gguf(path)
    eos = {gguf_field(reader, "tokenizer.ggml.eos_token_id")}
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos.add(eot)
    eos.discard(None)
    return Tokenizer(
        _tokenizer_backend(path, reader),
        eos_token_ids=frozenset(eos),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )


def _tokenizer_backend(path: Path, reader) -> HFTokenizer:
    cache = _tokenizer_cache_path(path)
    if cache is not None and cache.exists():
        return HFTokenizer.from_file(str(cache))
    backend = _build_tokenizer(reader)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            backend.save(str(tmp))
            tmp.replace(cache)
        except OSError:
            pass  # caching is an optimisation only
    return backend


def _build_tokenizer(reader) -> HFTokenizer:
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer {kind!r}; splitserve builds byte-level BPE (gpt2) only")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(PRE_TOKENIZER_SPLITS)}")
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    types = gguf_field(reader, "tokenizer.ggml.token_type") or []
    control = [
        AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types) if kind == 3
    ]  # 3: CONTROL
    backend.add_special_tokens(control)
    return backend


def _tokenizer_cache_path(path: Path) -> Path | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v1".encode()).hexdigest()[:24]
    root = Path(os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve")
    return root / "tokenizers" / f"{key}.json"
