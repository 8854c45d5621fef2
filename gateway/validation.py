"""Checks on a client's request, and its tokenization: the request a worker gets, or an error.

Sizes come first because tokenizing is the gateway's one expensive step (about a second per MB of
text): a request over a limit is refused by its length in bytes, before any tokenizer runs, and
any but a short prompt is tokenized on a thread: the event loop serves every stream, so it never
runs for long the one step whose cost grows with the client's input. Token ids and the context are
checked against what the healthy workers accept.
Every check raises an InvalidRequest (a ValueError) with a message saying what to change; the gRPC
API answers INVALID_ARGUMENT with it, the HTTP API a 400 whose error code is the one OpenAI's API
gives the same failure (the error's class says which: never its message).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from splitserve.common.sampling_params import OutOfRange, SamplingParams
from splitserve.common.tokenizer import Tokenizer, TooManyTokens
from splitserve.common.wire import params_to_proto, sampling_params_from_public
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb

KiB, MiB = 1 << 10, 1 << 20
GRPC_DEFAULT_MAX_RECEIVE_BYTES = 4 * MiB
_FRAMING_BYTES = 64 * KiB  # room in a gRPC message for the fields the limits do not count
# Prompts up to this size (characters of text, bytes of chat messages) are tokenized on the event loop,
# in well under a millisecond: they skip the thread hop and never wait for a thread behind big prompts.
_INLINE_PROMPT_SIZE = 512


class InvalidRequest(ValueError):
    """A request the gateway refuses. `code`: what OpenAI's API calls the failure (its error code);
    `param`: the field at fault, when one is."""

    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def openai_message(self) -> str:
        return str(self)


class TooLong(InvalidRequest):
    code = "string_above_max_length"


class TooMany(InvalidRequest):
    code = "array_above_max_length"


class UnknownModel(InvalidRequest):
    code = "model_not_found"


class ValueOutOfRange(InvalidRequest):
    """A sampling value outside its range (SamplingParams' OutOfRange), with OpenAI's code for it."""

    def __init__(self, error: OutOfRange) -> None:
        super().__init__(str(error), error.param)
        self.code = error.code


class ContextLengthExceeded(InvalidRequest):
    """The prompt and the tokens to generate do not fit the context. OpenAI clients (litellm,
    langchain) key on the code and on its message's wording, which openai_message gives."""

    code = "context_length_exceeded"

    def __init__(self, message: str, num_prompt_tokens: int, num_completion_tokens: int, max_model_len: int) -> None:
        super().__init__(message, "prompt" if num_completion_tokens <= 1 else "max_tokens")
        self.num_prompt_tokens, self.num_completion_tokens = num_prompt_tokens, num_completion_tokens
        self.max_model_len = max_model_len

    def openai_message(self) -> str:
        requested = self.num_prompt_tokens + self.num_completion_tokens
        return (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{requested} tokens ({self.num_prompt_tokens} in the prompt, {self.num_completion_tokens} in the "
            "completion). Please reduce the length of the prompt or completion."
        )


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may hold. A prompt over max_prompt_bytes is refused before tokenizing."""

    max_prompt_bytes: int = 1 * MiB  # prompt text (UTF-8), or the chat messages as sent (roles, contents, framing)
    max_stop_bytes: int = 1 * KiB  # each stop string (UTF-8)
    max_stop_total_bytes: int = 16 * KiB  # all stop strings together
    max_stops: int = 256  # stop strings and stop token ids, each
    max_request_id_bytes: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")

    @property
    def max_message_bytes(self) -> int:
        """The gRPC receive limit that lets every request within these limits through (never below
        gRPC's 4 MiB default); a bigger message fails in gRPC itself with RESOURCE_EXHAUSTED."""
        return max(GRPC_DEFAULT_MAX_RECEIVE_BYTES, self.max_prompt_bytes + self.max_stop_total_bytes + _FRAMING_BYTES)


def check_sizes(request: gen_pb.GenerateRequest, limits: RequestLimits) -> None:
    check_prompt_size(request, limits)
    check_stop_sizes(request.stopping, limits)
    num_id_bytes = len(request.request_id.encode())
    if num_id_bytes > limits.max_request_id_bytes:
        raise TooLong(
            f"request_id is {num_id_bytes} bytes; at most {limits.max_request_id_bytes} are accepted: send a shorter id"
        )


def check_prompt_size(request: gen_pb.GenerateRequest | gen_pb.TokenizeRequest, limits: RequestLimits) -> None:
    """The text, or the chat messages as sent, against --max-prompt-bytes (both requests have text and chat)."""
    kind = request.WhichOneof("prompt" if isinstance(request, gen_pb.GenerateRequest) else "input")
    if kind == "text":
        num_bytes, what = len(request.text.encode()), "prompt text"
    elif kind == "chat":
        num_bytes, what = request.chat.ByteSize(), "chat messages"
    else:
        return
    if num_bytes > limits.max_prompt_bytes:
        raise TooLong(
            f"{what} is {num_bytes} bytes; this gateway accepts at most {limits.max_prompt_bytes} "
            "(send a shorter prompt, or start the gateway with a higher --max-prompt-bytes)",
            "messages" if kind == "chat" else "prompt",
        )


def check_stop_sizes(stopping: gen_pb.StoppingCriteria, limits: RequestLimits) -> None:
    check_num_stops(len(stopping.stop), "stop strings", limits)
    check_num_stops(len(stopping.stop_token_ids), "stop token ids", limits)
    check_stop_strings(stopping.stop, limits)


def check_num_stops(count: int, what: str, limits: RequestLimits) -> None:
    """Counted before the items are read (a client can send a million of them)."""
    if count > limits.max_stops:
        raise TooMany(
            f"{count} {what} sent; at most {limits.max_stops} are accepted "
            "(send fewer, or start the gateway with a higher --max-stops)",
            "stop" if what == "stop strings" else "stop_token_ids",
        )


def check_stop_strings(stop: Sequence[str], limits: RequestLimits) -> None:
    sizes = [len(s.encode()) for s in stop]
    if sizes and max(sizes) > limits.max_stop_bytes:
        raise TooLong(
            f"a stop string is {max(sizes)} bytes; at most {limits.max_stop_bytes} are accepted "
            "(send a shorter one, or start the gateway with a higher --max-stop-bytes)",
            "stop",
        )
    if sum(sizes) > limits.max_stop_total_bytes:
        raise TooLong(
            f"the stop strings are {sum(sizes)} bytes together; at most {limits.max_stop_total_bytes} "
            "are accepted (send fewer, or start the gateway with a higher --max-stop-total-bytes)",
            "stop",
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Every id below the workers' vocabulary size (skipped while it is unknown: 0)."""
    if vocab_size and token_ids and max(token_ids) >= vocab_size:
        bad = [t for t in token_ids if t >= vocab_size][:5]
        param = "prompt" if what.startswith("prompt") else "stop_token_ids"
        raise InvalidRequest(f"{what} must be in [0, {vocab_size}) (the model's vocabulary); got {bad}", param)


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """Checked before copying a prompt's token ids too (a client can send a million of them)."""
    if not num_tokens:
        raise InvalidRequest("prompt is empty; send text, token ids or chat messages", "prompt")
    if max_model_len and num_tokens >= max_model_len:
        raise ContextLengthExceeded(
            f"prompt has {num_tokens} tokens but the model context is {max_model_len}; shorten the prompt",
            num_tokens,
            1,  # a request generates at least one token
            max_model_len,
        )


def check_fits_context(num_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    if max_tokens and max_model_len and num_tokens + max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model context of "
            f"{max_model_len}; lower max_tokens",
            num_tokens,
            max_tokens,
            max_model_len,
        )


def clip(text: str, num_chars: int = 64) -> str:
    """A client's string, short enough to quote in an error message."""
    return text if len(text) <= num_chars else text[:num_chars] + "..."


def _sampling_params(request: gen_pb.GenerateRequest, logprobs: int | None) -> SamplingParams:
    try:
        return sampling_params_from_public(request.sampling, request.stopping, logprobs)
    except OutOfRange as e:
        raise ValueOutOfRange(e) from None


class RequestValidator:
    """Turns a client's request into the request a worker runs: checked and tokenized once."""

    def __init__(self, limits: RequestLimits, tokenizer: Tokenizer, model_name: str, workers: WorkerSet) -> None:
        self.limits, self.tokenizer, self.model_name, self.workers = limits, tokenizer, model_name, workers

    async def worker_request(self, request: gen_pb.GenerateRequest, request_id: str) -> pb.WorkerGenerateRequest:
        """request_id: the client's, or one the gateway made for it (GenerationCore)."""
        check_sizes(request, self.limits)
        self._check_model(request.model)
        logprobs = request.logprobs if request.HasField("logprobs") else None
        params = _sampling_params(request, logprobs)
        check_token_ids(params.stop_token_ids, self._vocab_size(), "stop token ids")
        token_ids = await self._prompt_token_ids(request)
        max_model_len = self.max_model_len()  # read after tokenizing: workers may have come or gone meanwhile
        check_prompt_length(len(token_ids), max_model_len)
        check_token_ids(token_ids, self._vocab_size(), "prompt token ids")
        check_fits_context(len(token_ids), params.max_tokens, max_model_len)
        return pb.WorkerGenerateRequest(
            request_id=request_id, prompt_token_ids=token_ids, params=params_to_proto(params), priority=request.priority
        )

    async def tokenize(self, request: gen_pb.TokenizeRequest, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: whether plain text gets the model's BOS etc. (a chat template adds its own)."""
        check_prompt_size(request, self.limits)
        self._check_model(request.model)
        if request.WhichOneof("input") == "chat":
            return await _off_loop_if_long(request.chat.ByteSize(), self._encode_chat, request.chat)
        return await _off_loop_if_long(len(request.text), self.tokenizer.encode, request.text, add_special_tokens)

    def max_model_len(self) -> int:
        return self.workers.max_model_len(self.model_name)

    def _vocab_size(self) -> int:
        return self.workers.vocab_size(self.model_name)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise UnknownModel(f"unknown model {clip(model)!r}; this gateway serves {self.model_name!r}", "model")

    async def _prompt_token_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        kind, max_len = request.WhichOneof("prompt"), self.max_model_len()
        if kind == "token_ids":
            check_prompt_length(len(request.token_ids.ids), max_len)  # before copying them all
            return list(request.token_ids.ids)
        limit = max_len - 1 if max_len else None  # a prompt leaves room for one generated token
        try:
            if kind == "text" and request.text:
                return await _off_loop_if_long(
                    len(request.text), self.tokenizer.encode, request.text, max_num_tokens=limit
                )
            if kind == "chat" and request.chat.messages:
                return await _off_loop_if_long(request.chat.ByteSize(), self._encode_chat, request.chat, limit)
        except TooManyTokens as e:  # refused before its ids were built: give the usual message
            check_prompt_length(e.num_tokens, max_len)
            raise
        return []

    def _encode_chat(self, chat: gen_pb.ChatMessages, max_num_tokens: int | None = None) -> list[int]:
        """Rendering the template and tokenizing both grow with the messages (_off_loop_if_long)."""
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        return self.tokenizer.encode_chat(messages, max_num_tokens=max_num_tokens)


async def _off_loop_if_long(size: int, encode: Callable[..., list[int]], *args, **kwargs) -> list[int]:
    """encode(...) on a thread unless the prompt is short; the tokenizer releases the GIL, so the loop runs on."""
    if size <= _INLINE_PROMPT_SIZE:
        return encode(*args, **kwargs)
    return await asyncio.to_thread(encode, *args, **kwargs)
