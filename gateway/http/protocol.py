"""OpenAI request bodies -> the GenerateRequests the gateway runs (one per prompt).

/v1/completions: `prompt` is a string, a list of strings, token ids, or a list of token-id lists;
/v1/chat/completions: `messages` with text content. Each prompt runs `n` times: choice i of a
request is prompt i // n, sample i % n, and with a `seed` sample j uses seed + j (outputs differ,
yet the same request gives the same outputs). The n choices of a prompt share its one request
(validated and tokenized once). Values are range-checked by the same validator as gRPC requests;
here only types, the fields that have no proto counterpart, and what is refused. Counts a client
controls (prompts, token ids, stop strings) are checked against their limits before their items
are read, so that a hostile body costs no more than reading it.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from splitserve.gateway.http.errors import ApiError, bad_request, invalid_request
from splitserve.gateway.http.fields import UINT32_MAX, Fields, as_token_ids
from splitserve.gateway.validation import (
    InvalidRequest,
    RequestLimits,
    check_num_stops,
    check_prompt_length,
    check_stop_strings,
)
from splitserve.protos.v1 import generation_pb2 as gen_pb

MAX_LOGPROBS = 20  # the most alternatives a worker returns per token (SamplingParams.logprobs)
MAX_N = 128
_SEED_SPAN = 2**64  # the proto's seed is uint64; negative seeds (vLLM takes them) wrap around

# Accepted values of fields splitserve cannot honour (besides leaving them out or null): Fields.reject_unsupported.
_UNSUPPORTED_BOTH: dict[str, tuple[object, ...]] = {
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "prompt_embeds": (),
}
_UNSUPPORTED_COMPLETIONS = {**_UNSUPPORTED_BOTH, "suffix": ("",)}
# With tool_choice "none" the model calls no tool, so the tools sent are ignored (as OpenAI does).
_TOOLS: dict[str, tuple[object, ...]] = {"tools": ([],), "functions": ([],)}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_BOTH,
    **_TOOLS,
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
}


class Endpoint(enum.Enum):
    """The route, by the object type of its answers (non-streamed)."""

    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self is Endpoint.COMPLETIONS else "chatcmpl"


Prompt = str | tuple[int, ...] | gen_pb.ChatMessages


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a body is checked against while it is read, before anything is built from it."""

    served_model: str  # the model's name (what responses carry)
    max_choices: int  # generations in one request (the gateway's --max-pending)
    max_model_len: int = 0  # the workers' context, 0 while unknown (the validator checks it later)
    limits: RequestLimits = field(default_factory=RequestLimits)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    response_id: str  # cmpl-... / chatcmpl-...
    model: str  # the served model's name (what responses carry)
    prompts: tuple[Prompt, ...]
    n: int
    requests: tuple[gen_pb.GenerateRequest, ...]  # one per prompt; its n choices share it
    seed: int | None  # sample j of each prompt uses seed + j; None: unseeded
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage
    continuous_usage: bool  # streaming: every chunk carries its choice's usage so far (vLLM's)
    logprobs: int | None  # alternatives per token in the answers; None: no logprobs
    echo: bool  # completions: the prompt text before each choice's text
    stop: tuple[str, ...]  # stop strings (a stop_reason that is one of them stays a string)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choices(self) -> Iterator[tuple[int, str, int | None]]:
        """(prompt index, request id, seed) of each choice, in choice order."""
        for i in range(self.num_choices):
            seed = None if self.seed is None else (self.seed + i % self.n) % _SEED_SPAN
            yield i // self.n, f"{self.response_id}-{i}", seed


Parser = Callable[[object, Bounds, str | None], ParsedRequest]


def parse_completion(body: object, bounds: Bounds, request_id: str | None) -> ParsedRequest:
    f = Fields(body)
    f.reject_unsupported(_UNSUPPORTED_COMPLETIONS)
    prompts = _completion_prompts(f.get("prompt"), bounds)
    logprobs = f.integer("logprobs", None, 0, MAX_LOGPROBS)
    echo = f.boolean("echo", False)
    if echo and logprobs is not None:
        raise bad_request(
            "echo with logprobs needs the prompt's logprobs, which splitserve does not compute; drop one of them",
            "echo",
        )
    max_tokens = None if f.is_null("max_tokens") else f.integer("max_tokens", 16, 1, UINT32_MAX)
    return _parsed(f, Endpoint.COMPLETIONS, bounds, prompts, request_id, logprobs, max_tokens, echo)


def parse_chat(body: object, bounds: Bounds, request_id: str | None) -> ParsedRequest:
    f = Fields(body)
    ignored = _TOOLS if f.get("tool_choice") == "none" else {}
    f.reject_unsupported({k: v for k, v in _UNSUPPORTED_CHAT.items() if k not in ignored})
    messages = chat_messages(f.get("messages"))
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not f.boolean("logprobs", False):
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (top or 0) if f.boolean("logprobs", False) else None
    max_tokens = f.integer("max_completion_tokens", None, 1, UINT32_MAX)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", None, 1, UINT32_MAX)  # deprecated by OpenAI, still sent by many
    return _parsed(f, Endpoint.CHAT, bounds, (messages,), request_id, logprobs, max_tokens, False)


def _parsed(
    f: Fields,
    endpoint: Endpoint,
    bounds: Bounds,
    prompts: tuple[Prompt, ...],
    request_id: str | None,
    logprobs: int | None,
    max_tokens: int | None,
    echo: bool,
) -> ParsedRequest:
    model = _model(f, bounds.served_model)
    n = _n(f, len(prompts), bounds.max_choices)
    stream = f.boolean("stream", False)
    include_usage, continuous_usage = _usage_options(f, stream)
    stop = _stop(f, bounds.limits)
    priority = f.integer("priority", 0, -(2**31), 2**31 - 1)
    template = gen_pb.GenerateRequest(
        sampling=_sampling(f), stopping=_stopping(f, max_tokens, stop, bounds.limits), priority=priority
    )
    if logprobs is not None:
        template.logprobs = logprobs
    seed = f.integer("seed", None, -(2**63), _SEED_SPAN - 1)
    response_id = f"{endpoint.id_prefix}-{request_id or uuid.uuid4().hex}"
    requests = tuple(_prompt_request(template, prompt) for prompt in prompts)
    return ParsedRequest(
        endpoint,
        response_id,
        model,
        prompts,
        n,
        requests,
        seed,
        stream,
        include_usage,
        continuous_usage,
        logprobs,
        echo,
        stop,
    )


def _prompt_request(template: gen_pb.GenerateRequest, prompt: Prompt) -> gen_pb.GenerateRequest:
    request = gen_pb.GenerateRequest()
    request.CopyFrom(template)
    _set_prompt(request, prompt)
    return request


def _checked(check: Callable[..., None], *args: object) -> None:
    """A validator's check, its refusal as the HTTP API's 400."""
    try:
        check(*args)
    except InvalidRequest as e:
        raise invalid_request(e) from None


def _model(f: Fields, served_model: str) -> str:
    model = f.string("model", None)
    if model is not None and model != served_model:
        raise ApiError(
            404,
            f"the model {model[:64]!r} does not exist; this server serves {served_model!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    return served_model


def _n(f: Fields, num_prompts: int, max_choices: int) -> int:
    n = f.integer("n", 1, 1, MAX_N)
    assert n is not None  # a default was given
    best_of = f.integer("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported (only best_of = n, or left out)", "best_of")
    if num_prompts * n > max_choices:
        raise bad_request(
            f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} generations; this server takes at most "
            f"{max_choices} in one request (its --max-pending): send fewer prompts or a smaller n",
            "n",
        )
    return n


def _usage_options(f: Fields, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); the latter only with the former, as vLLM has it."""
    options = f.obj("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    include_usage = options.boolean("include_usage", False)
    return include_usage, include_usage and options.boolean("continuous_usage_stats", False)


def _stop(f: Fields, limits: RequestLimits) -> tuple[str, ...]:
    value = f.get("stop")
    if isinstance(value, list):
        _checked(check_num_stops, len(value), "stop strings", limits)
    stop = f.strings("stop")
    _checked(check_stop_strings, stop, limits)
    return stop


def _sampling(f: Fields) -> gen_pb.SamplingParameters:
    sampling = gen_pb.SamplingParameters(
        top_k=_top_k(f),
        min_p=f.number("min_p", 0.0),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
    )
    for name in ("temperature", "top_p", "repetition_penalty"):  # optional in the proto: unset is its default
        value = f.number(name, None)
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def _top_k(f: Fields) -> int:
    top_k = f.integer("top_k", 0, -1, UINT32_MAX)
    return 0 if top_k is None or top_k == -1 else top_k  # vLLM's -1 and 0 both mean off


def _stopping(
    f: Fields, max_tokens: int | None, stop: tuple[str, ...], limits: RequestLimits
) -> gen_pb.StoppingCriteria:
    value = f.get("stop_token_ids")
    if isinstance(value, list):
        _checked(check_num_stops, len(value), "stop token ids", limits)
    stopping = gen_pb.StoppingCriteria(
        min_tokens=f.integer("min_tokens", 0, 0, UINT32_MAX),
        stop=stop,
        stop_token_ids=f.token_ids("stop_token_ids"),
        ignore_eos=f.boolean("ignore_eos", False),
    )
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    return stopping


def _set_prompt(request: gen_pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, tuple):
        request.token_ids.ids.extend(prompt)
    else:
        request.chat.CopyFrom(prompt)


def _completion_prompts(value: object, bounds: Bounds) -> tuple[Prompt, ...]:
    """A string, a list of strings, token ids, or a list of token-id lists; lists are counted first."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if not isinstance(value[0], str | list):
            return (_token_prompt(value, bounds),)
        _check_num_prompts(len(value), bounds.max_choices)
        if isinstance(value[0], list):
            return tuple(_token_prompt(v, bounds) for v in value)
        if all(isinstance(v, str) for v in value):
            return tuple(value)
    raise _bad_prompt()


def _token_prompt(value: object, bounds: Bounds) -> tuple[int, ...]:
    """Token ids, their number checked against the context before they are read."""
    if not isinstance(value, list) or not value:
        raise _bad_prompt()
    _checked(check_prompt_length, len(value), bounds.max_model_len)
    ids = as_token_ids(value)
    if ids is None:
        raise _bad_prompt()
    return ids


def _check_num_prompts(num_prompts: int, max_choices: int) -> None:
    if num_prompts > max_choices:
        raise bad_request(
            f"{num_prompts} prompts sent; this server takes at most {max_choices} generations in one request "
            "(its --max-pending): send fewer prompts",
            "prompt",
        )


def _bad_prompt() -> ApiError:
    return bad_request(
        "prompt must be a string, a non-empty list of strings, a list of token ids (integers >= 0), "
        "or a list of non-empty token-id lists",
        "prompt",
    )


def chat_messages(value: object) -> gen_pb.ChatMessages:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    return gen_pb.ChatMessages(messages=[_chat_message(Fields(m, f"messages[{i}]")) for i, m in enumerate(value)])


def _chat_message(m: Fields) -> gen_pb.ChatMessage:
    role = m.string("role", None)
    if not role:
        raise bad_request(f"{m.param('role')} is required (system, user, assistant, ...)", m.param("role"))
    m.reject_unsupported({"tool_calls": ([],), "function_call": ()})
    return gen_pb.ChatMessage(role=role, content=_content(m))


def _content(m: Fields) -> str:
    """A string, or a list of text parts (joined by newlines, as vLLM does); null reads as empty."""
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [_text_part(Fields(p, f"{m.param('content')}[{i}]")) for i, p in enumerate(content)]
        return "\n".join(texts)
    raise bad_request(f"{m.param('content')} must be a string or a list of content parts", m.param("content"))


def _text_part(part: Fields) -> str:
    if part.string("type", None) != "text":
        raise bad_request(
            f"{part.param('type')}: only text content parts are supported (this server serves a text-only model)",
            part.param("type"),
        )
    text = part.string("text", None)
    if text is None:
        raise bad_request(f"{part.param('text')} is required", part.param("text"))
    return text
