"""Find, read and load a model: a Hugging Face folder or a GGUF file (default: bundled SmolLM2)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from splitserve.common.model_files import ModelLoadError, resolve_model_path
from splitserve.common.tokenizer import Tokenizer, hf_eos_ids, load_hf_tokenizer
from splitserve.services.model.arch import ModelArchConfig
from splitserve.services.model.attention.backend import AttentionBackend
from splitserve.services.model.llama import LlamaForCausalLM
from splitserve.services.model.parallel import SINGLE, TensorParallel


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
        from splitserve.services.model.gguf_loader import GGUFModel

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
    source: ModelSource,
    backend: AttentionBackend,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """Build on the meta device, cast there (free), allocate in the target dtype, then copy each
    checkpoint tensor in: peak memory ~ the weights in dtype plus one checkpoint tensor, never a
    float32 copy of the model (on a GPU its freed memory would stay in torch's cache). With tp, the
    model holds rank tp.rank's shard (see services/model/parallel.py): ValueError if tp.size cannot shard the
    model, or if backend is not built for tp.local_heads(arch)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(source.arch, backend, max_len, tp)
    model = model.to(dtype).to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    model.rotary.reset_table()  # float32 table, not in checkpoints; cast per use
    load_weights(model, source.tensors(), source.arch, tp)
    return model


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor]],
    arch: ModelArchConfig,
    tp: TensorParallel = SINGLE,
) -> None:
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up, each cut to tp.rank's shard
    before it is cast and copied. Errors name the tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        place = _target(hf_name, arch, tp)
        if place is None:
            continue
        if place.name not in params:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in {arch.architecture}")
        param = params[place.name].data
        dest = param if place.rows is None else param[place.rows.start : place.rows.stop]
        part = _rank_part(hf_name, tensor, tuple(dest.shape), place)
        with torch.no_grad():
            dest.copy_(part.to(dest.dtype))  # cast on the host: no float32 copy on the device
        loaded.add(hf_name)
    _zero_vocab_padding(params, arch, tp)
    expected = _expected_names(arch)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _rank_part(hf_name: str, tensor: torch.Tensor, dest_shape: tuple[int, ...], place: Placement) -> torch.Tensor:
    """The part of a checkpoint tensor this rank copies into dest: a view, so only that part is cast
    and copied. Checks the whole tensor's shape first (a slice of a wrong-sized one could fit)."""
    expected = list(dest_shape)
    if place.take is not None:
        expected[place.dim] = place.full
    if tuple(tensor.shape) != tuple(expected):
        raise ModelLoadError(
            f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, config expects {tuple(expected)}"
        )
    return tensor if place.take is None else tensor.narrow(place.dim, place.take.start, len(place.take))


def _zero_vocab_padding(params: Mapping[str, torch.Tensor], arch: ModelArchConfig, tp: TensorParallel) -> None:
    """Rows past the real vocab (the last ranks', when size does not divide it) are never read, but are
    zeroed rather than left as whatever memory to_empty handed out."""
    num_real = len(tp.vocab_range(arch.vocab_size))
    for name in ("embed_tokens.weight", "lm_head.weight"):
        params[name].data[num_real:].zero_()


class Placement(NamedTuple):
    """Where this rank's part of one checkpoint tensor goes."""

    name: str  # our parameter name
    rows: range | None  # the parameter rows it fills (fused projections, the vocab), None: all of them
    dim: int = 0  # the checkpoint dim this rank takes a part of...
    take: range | None = None  # ...that part (None: the whole tensor, replicated or unsharded)
    full: int = 0  # the checkpoint's size along dim, for the shape check


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _target(hf_name: str, arch: ModelArchConfig, tp: TensorParallel = SINGLE) -> Placement | None:
    """Our parameter for an HF tensor name, with tp.rank's part of it (rows for column-parallel
    projections and the vocab, columns for row-parallel ones) and, in fused projections, its rows."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and arch.tie_word_embeddings:
        return None
    if name in _VOCAB:
        held = tp.vocab_range(arch.vocab_size)
        return Placement(name, range(len(held)), 0, held, arch.vocab_size)
    parts = name.split(".")
    kind = parts[-2] if len(parts) >= 2 else ""
    if kind in _FUSED:
        fused, index = _FUSED[kind]
        shards = _column_shards(fused, arch, tp)
        start = sum(len(rows) for rows, _ in shards[:index])  # the fused rows before this part
        take, full = shards[index]
        return Placement(".".join(parts[:-2] + [fused, parts[-1]]), range(start, start + len(take)), 0, take, full)
    if kind in _ROW_PARALLEL and parts[-1] == "weight":
        take, full = _column_shards("qkv_proj" if kind == "o_proj" else "gate_up_proj", arch, tp)[0]
        return Placement(name, None, 1, take, full)
    return Placement(name, None)


def _column_shards(fused: str, arch: ModelArchConfig, tp: TensorParallel) -> list[tuple[range, int]]:
    """(rows this rank takes, the checkpoint's row count) of each part of a fused projection, in the
    fused order (q, k, v or gate, up); o_proj / down_proj take the columns matching part 0."""
    d = arch.head_dim
    if fused == "gate_up_proj":
        inter = tp.shard(arch.intermediate_size)
        return [(inter, arch.intermediate_size)] * 2
    q = tp.shard(arch.num_heads)
    kv = tp.kv_head_range(arch.num_kv_heads)
    q_rows = range(q.start * d, q.stop * d)
    kv_rows = range(kv.start * d, kv.stop * d)
    return [(q_rows, arch.num_heads * d), (kv_rows, arch.num_kv_heads * d), (kv_rows, arch.num_kv_heads * d)]


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
