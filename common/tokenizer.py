"""Tokenizer wrapper: a `tokenizers.Tokenizer`, special-token facts, and the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from jinja2 import Template  # imported when a chat template is first used


class TooManyTokens(ValueError):
    """The text has more tokens than the caller's max_num_tokens (found before the ids are built)."""

    def __init__(self, num_tokens: int, max_num_tokens: int) -> None:
        super().__init__(f"the prompt has {num_tokens} tokens; at most {max_num_tokens} are accepted")
        self.num_tokens = num_tokens


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF); HF folders do it in the post-processor
        self.chat_template = chat_template
        self._compiled_template: Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True, *, max_num_tokens: int | None = None) -> list[int]:
        """Token ids of text; with max_num_tokens, more tokens than that raise TooManyTokens (BOS aside)."""
        ids = self._encode_ids(text, add_special_tokens, max_num_tokens)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[ChatMessage] | list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos_id = min(self.eos_token_ids) if self.eos_token_ids else None
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled_template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=(self.id_to_token(eos_id) or "") if eos_id is not None else "",
            )
        except TemplateError as e:  # raise_exception(...) in the template, or a message it cannot render
            raise ValueError(f"the model's chat template rejected these messages: {e}") from None

    def encode_chat(
        self, messages, add_generation_prompt: bool = True, *, max_num_tokens: int | None = None
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self._encode_ids(text, False, max_num_tokens)

    def _encode_ids(self, text: str, add_special_tokens: bool, max_num_tokens: int | None) -> list[int]:
        # The batch calls release the GIL while they run (encode holds it: 4 s for 4 MB of text), so a
        # thread tokenizing a big prompt leaves the gateway's event loop running; _fast skips char offsets.
        # Building the ids list holds the GIL (50 ms for a million tokens): a prompt over max_num_tokens
        # is refused by its length first.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # _fast: tokenizers>=0.20.1
        encoding = encode([text], add_special_tokens=add_special_tokens)[0]
        if max_num_tokens is not None and len(encoding) > max_num_tokens:
            raise TooManyTokens(len(encoding), max_num_tokens)
        return encoding.ids


def _compile_template(source: str) -> Template:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    return env.from_string(source)


def load_tokenizer(model: str | Path | None) -> Tokenizer:
    """The tokenizer of a model folder or GGUF file (default: the bundled SmolLM2), torch-free."""
    from splitserve.common.model_files import resolve_model_path

    path = resolve_model_path(model)
    if path.is_file():
        from splitserve.common.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path, hf_eos_ids(path, json.loads((path / "config.json").read_text())))


def hf_eos_ids(folder: Path, cfg: dict) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    gen = folder / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.exists() else {}, cfg):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return frozenset({value})
        if isinstance(value, list) and value:
            return frozenset(v for v in value if isinstance(v, int))
    return frozenset()


def load_hf_tokenizer(folder: Path, eos_token_ids: frozenset[int]) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (splitserve needs a fast tokenizer file)")
    backend = HFTokenizer.from_file(str(path))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text()
    bos = _token_id(backend, cfg.get("bos_token"))
    eos = _token_id(backend, cfg.get("eos_token"))
    if not eos_token_ids and eos is not None:
        eos_token_ids = frozenset({eos})
    return Tokenizer(backend, eos_token_ids=eos_token_ids, bos_token_id=bos, add_bos=False, chat_template=template)


def _token_id(backend: HFTokenizer, token) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
