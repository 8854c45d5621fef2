"""GenerateResponses -> OpenAI's objects: stream chunks (server-sent events), whole answers,
logprobs with token strings from the gateway's tokenizer, usage.

A choice's text is the concatenation of its responses' text (the worker detokenizes and holds back
stop strings); token strings for logprobs are each token decoded on its own, as vLLM gives them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.common.tokenizer import Tokenizer
from splitserve.gateway.http.protocol import Endpoint, ParsedRequest
from splitserve.protos.v1 import generation_pb2 as gen_pb

DONE_EVENT = b"data: [DONE]\n\n"
_FINISH_REASONS = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
}
_LOWEST_LOGPROB = -9999.0  # what -inf becomes: JSON has no infinities (vLLM's choice too)


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class TokenStrings:
    """Token id -> its text alone, cached (logprobs name each token and each alternative)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def prompt_text(self, prompt) -> str:
        """What echo puts before a completion: the prompt as sent, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt), skip_special_tokens=False)


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters of text before the next token (completions logprobs' text_offset)
    num_tokens: int = 0  # completion tokens so far
    started: bool = False  # streaming: its first chunk went out
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: gen_pb.Usage | None = None


class ResponseShaper:
    """One HTTP request's answer, built from its choices' responses (streamed or whole)."""

    def __init__(self, parsed: ParsedRequest, strings: TokenStrings, num_prompt_tokens: Sequence[int] = ()) -> None:
        """num_prompt_tokens: each prompt's, for continuous usage stats (known once the streams started)."""
        self.parsed, self.strings, self.num_prompt_tokens = parsed, strings, num_prompt_tokens
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(parsed.num_choices)]
        self.chat = parsed.endpoint is Endpoint.CHAT
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    # --- streaming ---
    def opening_events(self) -> list[bytes]:
        """Chat: each choice's first chunk, the assistant role with empty content (as OpenAI sends)."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [
            self._event([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], self._running(i))
            for i in range(len(self.choices))
        ]

    def event(self, index: int, response: gen_pb.GenerateResponse) -> bytes | None:
        """The chunk for one response of choice index; None when it adds nothing a client sees."""
        state = self.choices[index]
        text = self._observe(index, response)
        if not text and not response.logprobs and state.finish_reason is None:
            return None
        logprobs = self._logprobs(state, response.logprobs, text) if self.parsed.logprobs is not None else None
        choice: dict = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=state.finish_reason)
        if state.finish_reason is not None:
            choice["stop_reason"] = state.stop_reason
        return self._event([choice], self._running(index))

    def usage_event(self) -> bytes:
        return self._event([], usage=self.usage())

    def _running(self, index: int) -> dict | None:
        """Choice index's usage so far, on its chunks with continuous usage stats (vLLM's), else None."""
        if not self.parsed.continuous_usage:
            return None
        prompt = self.num_prompt_tokens[index // self.parsed.n] if self.num_prompt_tokens else 0
        completion = self.choices[index].num_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _event(self, choices: list[dict], usage: dict | None = None) -> bytes:
        payload = {"id": self.parsed.response_id, "object": self.object, "created": self.created}
        payload.update(model=self.parsed.model, choices=choices)
        if self.parsed.include_usage:
            payload["usage"] = usage
        return sse(payload)

    # --- whole answers ---
    def add(self, index: int, response: gen_pb.GenerateResponse) -> None:
        self._observe(index, response)
        self.choices[index].logprobs.extend(response.logprobs)

    def body(self) -> dict:
        choices = [self._whole_choice(i, state) for i, state in enumerate(self.choices)]
        return {
            "id": self.parsed.response_id,
            "object": self.parsed.endpoint.value,
            "created": self.created,
            "model": self.parsed.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def _whole_choice(self, index: int, state: ChoiceState) -> dict:
        text = "".join(state.texts)
        logprobs = None
        if self.parsed.logprobs is not None:
            state.text_offset = 0
            logprobs = self._logprobs(state, state.logprobs, text)
        choice: dict = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=state.finish_reason, stop_reason=state.stop_reason)
        return choice

    # --- both ---
    def _observe(self, index: int, response: gen_pb.GenerateResponse) -> str:
        """Records the response on its choice; returns the text it adds (with the prompt first, for echo)."""
        state, text = self.choices[index], response.text
        if not state.started:
            state.started = True
            if self.parsed.echo:
                text = self.strings.prompt_text(self.parsed.prompts[index // self.parsed.n]) + text
        state.texts.append(text)
        state.num_tokens += len(response.token_ids)
        if response.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
            state.finish_reason = _FINISH_REASONS[response.finish_reason]
            state.stop_reason = _stop_reason(response.stop_reason, self.parsed.stop)
            state.usage = response.usage
        return text

    def usage(self) -> dict:
        """Prompt tokens (and cached ones) count once per prompt, from its first choice; completions: all."""
        firsts = [self.choices[i].usage for i in range(0, len(self.choices), self.parsed.n)]
        prompt = sum(u.prompt_tokens for u in firsts if u is not None)
        cached = sum(u.cached_prompt_tokens for u in firsts if u is not None)
        completion = sum(s.usage.completion_tokens for s in self.choices if s.usage is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(self, state: ChoiceState, entries, text: str) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens = [self.strings(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "tokens": tokens,
            "top_logprobs": [self._top_dict(e, token) for e, token in zip(entries, tokens)],
        }

    def _top_dict(self, entry: gen_pb.TokenLogprob, token: str) -> dict[str, float]:
        """The alternatives and the sampled token (vLLM's completions include it even when not among them)."""
        top = {self.strings(t.token_id): _finite(t.logprob) for t in entry.top}
        top.setdefault(token, _finite(entry.logprob))
        return top

    def _chat_logprob(self, entry: gen_pb.TokenLogprob) -> dict:
        item = self._chat_token(entry.token_id, entry.logprob)
        item["top_logprobs"] = [self._chat_token(t.token_id, t.logprob) for t in entry.top]
        return item

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        token = self.strings(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOWEST_LOGPROB


def _stop_reason(reason: str, stop_strings: tuple[str, ...]) -> int | str | None:
    """The proto carries a stop token id as its decimal string: back to an int, as vLLM gives it,
    unless it is one of the request's stop strings."""
    if not reason:
        return None
    if reason in stop_strings or not reason.isdigit():
        return reason
    return int(reason)
