"""Find, read and load a model: a Hugging Face folder or a GGUF file (default: bundled SmolLM2)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.common.model_files import ModelLoadError, resolve_model_path
from splitserve.common.tokenizer import Tokenizer, hf_eos_ids, load_hf_tokenizer
from splitserve.model.arch import ModelArchConfig
from splitserve.model.attention.backend import AttentionBackend
from splitserve.model.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model on disk: its architecture and tokenizer, with weights read lazily."""

    path: Path
    arch: ModelArchConfig
    tokenizer: Tokenizer
    _tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # (HF name, tensor), read lazily

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()


def open_model(model: str | Path | None) -> ModelSource:
    path = resolve_model_path(model)
    if path.is_file():
        from splitserve.model.gguf_loader import GGUFModel

        gguf_model = GGUFModel(path)
        return ModelSource(path, gguf_model.arch, gguf_model.tokenizer(), gguf_model.hf_tensors)
    return _open_hf_folder(path)


def _open_hf_folder(folder: Path) -> ModelSource:
    cfg = json.loads((folder / "config.json").read_text())
    arch = ModelArchConfig.from_hf_config(cfg)
    files = _safetensors_files(folder)
    tokenizer = load_hf_tokenizer(folder, hf_eos_ids(folder, cfg))
    return ModelSource(folder, arch, tokenizer, lambda: _read_safetensors(files))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise ModelLoadError(f"{index.name} lists files that are missing from {folder}: {missing}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    source: ModelSource, backend: AttentionBackend, max_len: int, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """Build on the meta device, cast there (free), allocate in the target dtype, then copy each
    checkpoint tensor in: peak memory ~ the weights in dtype plus one checkpoint tensor, never a
    float32 copy of the model (on a GPU its freed memory would stay in torch's cache)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(source.arch, backend, max_len)
    model = model.to(dtype).to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    model.rotary.reset_table()  # float32 table, not in checkpoints; cast per use
    load_weights(model, source.tensors(), source.arch)
    return model


def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], arch: ModelArchConfig) -> None:
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up. Errors name the tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        target = _target(hf_name, arch)
        if target is None:
            continue
        name, rows = target
        if name not in params:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in {arch.architecture}")
        dest = params[name].data if rows is None else params[name].data[rows[0] : rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, config expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor.to(dest.dtype))  # cast on the host: no float32 copy on the device
        loaded.add(hf_name)
    expected = _expected_names(arch)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _target(hf_name: str, arch: ModelArchConfig) -> tuple[str, tuple[int, int] | None] | None:
    """Our parameter name for an HF tensor name, plus the row range for fused projections."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and arch.tie_word_embeddings:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
        bounds = {"qkv_proj": [0, q, q + kv, q + 2 * kv], "gate_up_proj": [0, inter, 2 * inter]}[fused]
        return ".".join(parts[:-2] + [fused, parts[-1]]), (bounds[index], bounds[index + 1])
    return name, None


def _expected_names(arch: ModelArchConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    if arch.qkv_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    return {f"model.layers.{i}.{p}" for i in range(arch.num_layers) for p in per_layer} | names
