"""Weights are loaded straight into the target dtype: the peak memory of build_model in bf16 is ~2 bytes
per parameter plus one checkpoint tensor, never a float32 copy of the model (on a GPU that copy's freed
memory would stay in torch's cache and starve the KV cache).

Measured on CPU by a dispatch mode that counts the bytes of every live CPU tensor storage made by a
torch op (the checkpoint tensors are made inside it too), so the peak is exact and repeatable.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from splitserve.services.model.arch import ModelArchConfig
from splitserve.services.model.attention.torch_backend import TorchAttention
from splitserve.services.model.loader import ModelSource, build_model

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 256, 1024, 8, 1024, 4, 2
ARCH = ModelArchConfig.from_hf_config(
    dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
)


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU tensor storages alive now, and the most at once, among those torch ops made."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[int] = set()
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()  # a storage keeps its Python object while it lives
        if key in self.seen or not size:
            return
        self.seen.add(key)
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.now -= size


def checkpoint() -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of ARCH."""
    q, kv = HEADS * (HIDDEN // HEADS), KV_HEADS * (HIDDEN // HEADS)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    per_layer = {
        "self_attn.q_proj.weight": (q, HIDDEN),
        "self_attn.k_proj.weight": (kv, HIDDEN),
        "self_attn.v_proj.weight": (kv, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, q),
        "mlp.gate_proj.weight": (INTER, HIDDEN),
        "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    for i in range(LAYERS):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def float32_tensors():
    """A float32 checkpoint, read one tensor at a time (as safetensors and GGUF files are)."""
    for i, (name, shape) in enumerate(checkpoint().items()):
        yield name, torch.randn(shape, generator=torch.Generator().manual_seed(i))


def test_bf16_load_peaks_near_two_bytes_per_parameter():
    source = ModelSource(None, ARCH, None, float32_tensors)
    with LiveBytes() as live:
        model = build_model(
            source, TorchAttention(HEADS, KV_HEADS, HIDDEN // HEADS, 8), 64, torch.bfloat16, torch.device("cpu")
        )
    num_params = sum(p.numel() for p in model.parameters())
    largest = max(torch.Size(s).numel() for s in checkpoint().values())
    # The bf16 weights; in flight, two float32 checkpoint tensors (the last one read and the next) and
    # a bf16 cast; the float32 RoPE tables and their temporaries.
    assert live.peak <= 2 * num_params + (4 + 4 + 2) * largest + 64 * 1024
    assert live.peak < 2.3 * num_params  # building in float32 first peaked at 4.25 bytes/parameter
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == model.rotary.sin.dtype == torch.float32


def test_loaded_values_are_the_checkpoint_rounded_once():
    model = build_model(
        ModelSource(None, ARCH, None, float32_tensors),
        TorchAttention(HEADS, KV_HEADS, HIDDEN // HEADS, 8),
        64,
        torch.bfloat16,
        torch.device("cpu"),
    )
    tensors = dict(float32_tensors())
    params = dict(model.named_parameters())
    assert torch.equal(params["embed_tokens.weight"], tensors["model.embed_tokens.weight"].bfloat16())
    q = tensors["model.layers.3.self_attn.q_proj.weight"].bfloat16()
    assert torch.equal(params["layers.3.self_attn.qkv_proj.weight"][: q.shape[0]], q)
    in_float32 = build_model(
        ModelSource(None, ARCH, None, float32_tensors),
        TorchAttention(HEADS, KV_HEADS, HIDDEN // HEADS, 8),
        64,
        torch.float32,
        torch.device("cpu"),
    )
    assert torch.equal(model.rotary.cos, in_float32.rotary.cos)  # RoPE tables stay float32
