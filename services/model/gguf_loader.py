"""Load a GGUF file: architecture from metadata, weights dequantized with the `gguf` package and
renamed to the Hugging Face layout, tokenizer rebuilt from the embedded vocab and merges."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from splitserve.services.model.arch import ModelArchConfig, ModelLoadError, RopeScaling
from splitserve.services.model.tokenizer import Tokenizer

# GGUF general.architecture -> (HF architecture, llama.cpp permuted the Q/K rows)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> pre-tokenizer regexes, applied in order (as llama.cpp does).
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then the GPT-2 split
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


class GGUFModel:
    def __init__(self, path: Path) -> None:
        import gguf

        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package raises plain ValueErrors on bad magic etc.
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.path = path
        self.gguf_arch = self._get("general.architecture")
        if self.gguf_arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"unsupported GGUF architecture {self.gguf_arch!r}; "
                                 f"splitserve supports {sorted(GGUF_ARCHITECTURES)}")
        self.arch = self._arch_config()

    def _get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_config(self) -> ModelArchConfig:
        a = self.gguf_arch
        hf_arch, _ = GGUF_ARCHITECTURES[a]
        hidden = self._get(f"{a}.embedding_length")
        num_heads = self._get(f"{a}.attention.head_count")
        tensor_names = {t.name for t in self.reader.tensors}
        factors = None
        if "rope_freqs.weight" in tensor_names:
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            factors = tuple(float(x) for x in np.asarray(t.data).reshape(-1))
        return ModelArchConfig(
            architecture=hf_arch,
            vocab_size=self._get(f"{a}.vocab_size") or len(self._get("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=self._get(f"{a}.feed_forward_length"),
            num_layers=self._get(f"{a}.block_count"),
            num_heads=num_heads,
            num_kv_heads=self._get(f"{a}.attention.head_count_kv") or num_heads,
            head_dim=self._get(f"{a}.rope.dimension_count") or hidden // num_heads,
            rms_norm_eps=float(self._get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._get(f"{a}.context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias=f"blk.0.attn_q.bias" in tensor_names,
            rope_freq_factors=factors,
        )

    def _rope_scaling(self) -> RopeScaling:
        kind = self._get(f"{self.gguf_arch}.rope.scaling.type", "none")
        if kind in ("none", None):
            return RopeScaling("default")
        if kind != "linear":
            raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}")
        return RopeScaling("linear", factor=float(self._get(f"{self.gguf_arch}.rope.scaling.factor", 1.0)))

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every weight, with llama.cpp's Q/K row permutation undone."""
        from gguf.quants import dequantize

        _, permuted = GGUF_ARCHITECTURES[self.gguf_arch]
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
            tensor = torch.from_numpy(np.array(array.reshape(shape), copy=True))
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = self.arch.num_heads if "q_proj" in name else self.arch.num_kv_heads
                tensor = _unpermute(tensor, heads)
            yield name, tensor

    def tokenizer(self) -> Tokenizer:
        eos = {self._get("tokenizer.ggml.eos_token_id")}
        eot = self._get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos.add(eot)
        eos.discard(None)
        return Tokenizer(
            self._tokenizer_backend(),
            eos_token_ids=frozenset(eos),
            bos_token_id=self._get("tokenizer.ggml.bos_token_id"),
            add_bos=bool(self._get("tokenizer.ggml.add_bos_token", False)),
            chat_template=self._get("tokenizer.chat_template"),
        )

    def _tokenizer_backend(self) -> HFTokenizer:
        cache = _tokenizer_cache_path(self.path)
        if cache is not None and cache.exists():
            return HFTokenizer.from_file(str(cache))
        backend = self._build_tokenizer()
        if cache is not None:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                backend.save(str(tmp))
                tmp.replace(cache)
            except OSError:
                pass  # caching is an optimisation only
        return backend

    def _build_tokenizer(self) -> HFTokenizer:
        kind = self._get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"unsupported GGUF tokenizer {kind!r}; splitserve builds byte-level BPE (gpt2) only")
        tokens: list[str] = self._get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self._get("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = self._get("tokenizer.ggml.pre", "default")
        splits = PRE_TOKENIZER_SPLITS.get(pre)
        if splits is None:
            raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(PRE_TOKENIZER_SPLITS)}")
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        types = self._get("tokenizer.ggml.token_type") or []
        control = [AddedToken(tok, special=True, normalized=False)
                   for tok, kind in zip(tokens, types) if kind == 3]  # 3: CONTROL
        backend.add_special_tokens(control)
        return backend


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in _LAYER_NAMES:
        return None  # rope_freqs and other non-weights
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary halves in Q/K rows ([out, ...])."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tokenizer_cache_path(path: Path) -> Path | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v1".encode()).hexdigest()[:24]
    root = Path(os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve")
    return root / "tokenizers" / f"{key}.json"
