"""Turns the step's logits into tokens: penalties, min_tokens, greedy or seeded random sampling.

Each seeded request owns a torch.Generator, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from splitserve.engine.request import Request

log = logging.getLogger("splitserve.sampler")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the raw model logits (before penalties and temperature)
    top: tuple[tuple[int, float], ...]  # the top-N (token id, logprob), best first


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int | None]  # None where the request failed
    logprobs: list[TokenLogprobs | None]
    errors: list[tuple[Request, Exception]] = field(default_factory=list)  # requests whose own processing failed


class Sampler:
    def __init__(self, seed: int) -> None:
        self._shared = torch.Generator().manual_seed(seed)  # for requests without a seed
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def get_state(self, request_id: str) -> bytes | None:
        """A seeded request's generator state (to continue it in another process), else None."""
        gen = self._generators.get(request_id)
        return None if gen is None else bytes(gen.get_state().numpy().tobytes())

    def set_state(self, request_id: str, state: bytes) -> None:
        gen = torch.Generator()
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._generators[request_id] = gen

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """logits: [num_requests, vocab] float32, one row per request.

        A request whose own logits processing raises is left out (in `errors`) before any
        generator is drawn from, so the others sample exactly as they would have without it.
        """
        raw = logits
        logits = logits.clone() if any(_needs_processing(r) for r in requests) else logits
        errors: list[tuple[Request, Exception]] = []
        for row, request in enumerate(requests):
            try:
                _apply_penalties(logits[row], request)
                _block_stop_tokens(logits[row], request)
            except Exception as e:  # isolation boundary: this request's parameters, not the batch
                log.exception("logits processing failed for request %s", request.request_id)
                errors.append((request, e))
        if errors:
            return self._sample_without(raw, logits, requests, errors)
        if all(r.sampling_params.greedy for r in requests):
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            token_ids = [self._sample_row(logits[row], r) for row, r in enumerate(requests)]
        return SampleResult(token_ids, _logprobs(raw, requests, token_ids))

    def _sample_without(
        self, raw: torch.Tensor, logits: torch.Tensor, requests: list[Request], errors: list[tuple[Request, Exception]]
    ) -> SampleResult:
        failed = {id(r) for r, _ in errors}
        token_ids: list[int | None] = [None] * len(requests)
        keep = [row for row, r in enumerate(requests) if id(r) not in failed]
        for row in keep:
            token_ids[row] = self._sample_row(logits[row], requests[row])
        kept = _logprobs(raw[keep], [requests[row] for row in keep], [t for t in token_ids if t is not None])
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for row, lp in zip(keep, kept):
            logprobs[row] = lp
        return SampleResult(token_ids, logprobs, errors)

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.sampling_params
        if params.greedy:
            return int(row.argmax())
        probs = _filtered_probs(row.cpu() / params.temperature, params.top_k, params.top_p, params.min_p)
        generator = self._generator_for(request)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws a token with probability p.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return gen


def _needs_processing(r: Request) -> bool:
    return r.sampling_params.has_penalties or r.num_output_tokens < r.sampling_params.min_tokens


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    params = request.sampling_params
    if not params.has_penalties:
        return
    device = row.device
    if params.repetition_penalty != 1.0:  # over prompt and output, as transformers does
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.int64, device=device)
        scores = row[seen]
        p = params.repetition_penalty
        row[seen] = torch.where(scores < 0, scores * p, scores / p)
    if params.presence_penalty or params.frequency_penalty:  # over output only, as OpenAI does
        out = torch.tensor(request.output_token_ids, dtype=torch.int64, device=device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _block_stop_tokens(row: torch.Tensor, request: Request) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be sampled."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return
    blocked = set(params.stop_token_ids)
    if not params.ignore_eos:
        blocked |= request.eos_token_ids
    if blocked:
        row[torch.tensor(sorted(blocked), dtype=torch.int64, device=row.device)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, top_k: int | None, top_p: float, min_p: float) -> torch.Tensor:
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop = cumulative - sorted_probs >= top_p  # keep the smallest set whose mass reaches top_p
        probs = probs.clone()
        probs[order[drop]] = 0.0
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs


def _logprobs(raw: torch.Tensor, requests: list[Request], token_ids: list[int]) -> list[TokenLogprobs | None]:
    wanted = [r.sampling_params.logprobs for r in requests]
    if all(n is None for n in wanted):
        return [None] * len(requests)
    logprobs = torch.log_softmax(raw, dim=-1).cpu()
    result: list[TokenLogprobs | None] = []
    for row, (n, token) in enumerate(zip(wanted, token_ids)):
        if n is None:
            result.append(None)
            continue
        top = torch.topk(logprobs[row], n) if n else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        result.append(TokenLogprobs(token, float(logprobs[row, token]), pairs))
    return result
