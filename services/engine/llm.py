"""Offline batch generation: LLM(...).generate(prompts, SamplingParams)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import Engine, PromptInput
from splitserve.services.engine.request import FinishReason
from splitserve.services.engine.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.engine = Engine(config or EngineConfig(**overrides))
        # An LLM nobody closes stops its tensor-parallel ranks once it is collected, or at exit.
        self._finalizer = weakref.finalize(self, self.engine.close)
        self.tokenizer = self.engine.tokenizer
        # Decode graphs are captured by the warm-up, as a worker runs it before serving; without it
        # --cuda-graphs would silently run every step eagerly here.
        self.warm_up_report = self.engine.warm_up() if self.engine.config.cuda_graphs.enabled else None

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (if any); this LLM generates nothing more."""
        self._finalizer()  # calls engine.close once, whoever calls first

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order."""
        batch = _as_batch(prompts)
        params_list = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        if len(params_list) != len(batch):
            raise ValueError(f"got {len(batch)} prompts but {len(params_list)} sampling params")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(batch, params_list)]  # validate all first
        outputs: dict[str, CompletionOutput] = {
            r.request_id: CompletionOutput(r.request_id, list(r.all_token_ids)) for r in requests
        }
        for request in requests:
            self.engine.add_request(request)
        while self.engine.has_unfinished_requests():
            for step_out in self.engine.step():
                _merge(outputs[step_out.request_id], step_out)
        return list(outputs.values())

    def chat(self, messages_list: Sequence[list[dict]], params: SamplingParams | None = None) -> list[CompletionOutput]:
        prompts = [self.tokenizer.encode_chat(m) for m in messages_list]
        return self.generate(prompts, params)


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]  # a single token-id prompt
    return list(prompts)  # type: ignore[arg-type]


def _merge(out: CompletionOutput, step) -> None:
    out.token_ids.extend(step.new_token_ids)
    out.text += step.new_text
    if step.new_logprobs is not None:
        out.logprobs = (out.logprobs or []) + step.new_logprobs
    out.finish_reason, out.stop_reason = step.finish_reason, step.stop_reason
    out.num_cached_tokens = step.num_cached_tokens
