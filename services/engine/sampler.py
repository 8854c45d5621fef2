"""Turns the step's logits into tokens: penalties, min_tokens, greedy or seeded random sampling.

A batch of plain greedy requests (no penalties, logprobs or min_tokens) is one argmax. Otherwise
one pass over the requests gathers their parameters on the host (the per-request isolation
boundary); then the whole batch is processed by a fixed number of tensor ops on the logits' device
(services/engine/sampling_ops.py). The only per-row work left is drawing a seeded request's noise from a
generator keyed by (seed, position), so its tokens depend neither on what else is batched nor on
which worker samples them: a stream moved to another worker continues on the same draws. Logprobs are computed for
the whole step at once (LogprobsRows) and formatted per request later, off the step loop, by the
output processor.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine import sampling_ops as ops
from splitserve.services.engine.request import Request

log = logging.getLogger("splitserve.sampler")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the raw model logits (before penalties and temperature)
    top: tuple[tuple[int, float], ...]  # the top-N (token id, logprob), best first


@dataclass(slots=True)
class LogprobsRows:
    """One step's logprobs of the requests that asked for them, as CPU tensors (formatted on demand)."""

    request_ids: list[str]  # one row each
    positions: list[int]  # each row's index in the sampled requests
    token_ids: list[int]  # each row's sampled token
    sampled: torch.Tensor  # [rows] float32: the sampled token's logprob
    top_ids: torch.Tensor  # [rows, max_top] int64, best first
    top_values: torch.Tensor  # [rows, max_top] float32
    num_top: list[int]  # how many of the top entries each row asked for
    _row_of: dict[str, int] | None = None

    def get(self, request_id: str) -> TokenLogprobs | None:
        if self._row_of is None:
            self._row_of = {rid: row for row, rid in enumerate(self.request_ids)}
        row = self._row_of.get(request_id)
        return None if row is None else self.format(row)

    def format(self, row: int) -> TokenLogprobs:
        n = self.num_top[row]
        top = tuple(zip(self.top_ids[row, :n].tolist(), self.top_values[row, :n].tolist()))
        return TokenLogprobs(self.token_ids[row], float(self.sampled[row]), top)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int | None]  # None where the request failed
    rows: LogprobsRows | None = None  # None: no request asked for logprobs
    errors: list[tuple[Request, Exception]] = field(default_factory=list)  # requests whose own processing failed

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """Each request's logprobs, formatted now (the engine leaves that to the output processor)."""
        result: list[TokenLogprobs | None] = [None] * len(self.token_ids)
        if self.rows is not None:
            for row, position in enumerate(self.rows.positions):
                result[position] = self.rows.format(row)
        return result


class Generators:
    """The sampler's generators: one shared per device for the unseeded requests, and one per device
    that a seeded request's row is re-keyed on before each draw (ops.noise_seed), so its noise is a
    function of (seed, position) alone: any worker, any batch, any process draws the same numbers for
    the same token, and a request carries no generator state between steps or workers."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._keyed: dict[torch.device, torch.Generator] = {}

    def shared(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
        return gen

    def keyed(self, device: torch.device, seed: int, position: int) -> torch.Generator:
        """The device's keyed generator, set for the token at `position` of a request seeded `seed`."""
        gen = self._keyed.get(device)
        if gen is None:
            gen = self._keyed[device] = torch.Generator(device=device)
        return gen.manual_seed(ops.noise_seed(seed, position))


@dataclass(slots=True)
class _Pairs:
    """(row, token id) pairs gathered on the host, for one index op over the batch."""

    rows: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # how many token ids each of rows has
    token_ids: array[int] = field(default_factory=lambda: array("q"))  # int64, read by torch without a copy

    def add(self, row: int, token_ids: list[int]) -> None:
        if token_ids:
            self.rows.append(row)
            self.counts.append(len(token_ids))
            self.token_ids.extend(token_ids)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[m] int64 rows and token ids."""
        rows = torch.repeat_interleave(torch.tensor(self.rows), torch.tensor(self.counts))
        return rows.to(device), torch.frombuffer(self.token_ids, dtype=torch.int64).to(device)


@dataclass(slots=True)
class _Filter:
    """The sampled rows (positions in the sampled sub-batch) that use one filter, and its values."""

    rows: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, values: Iterable[float | None]) -> _Filter:
        """From each sampled row's value, None where the row does not use the filter."""
        found = cls()
        for row, value in enumerate(values):
            if value is not None:
                found.rows.append(row)
                found.values.append(value)
        return found

    def row_tensor(self, num_rows: int, device: torch.device) -> torch.Tensor | None:
        """The rows' indices, or None when every row uses the filter."""
        return None if len(self.rows) == num_rows else torch.tensor(self.rows, dtype=torch.int64, device=device)

    def value_tensor(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(self.values, dtype=dtype, device=device)


@dataclass(slots=True)
class _Plan:
    """One step's parameters, gathered in one pass over the requests that did not fail."""

    requests: list[Request] = field(default_factory=list)
    repetition: _Pairs = field(default_factory=_Pairs)  # prompt + output tokens, rows with repetition_penalty
    output: _Pairs = field(default_factory=_Pairs)  # output tokens, rows with presence/frequency penalties
    blocked: _Pairs = field(default_factory=_Pairs)  # EOS / stop ids, rows still under min_tokens
    greedy_rows: list[int] = field(default_factory=list)
    unseeded_rows: list[int] = field(default_factory=list)
    seeded_rows: list[int] = field(default_factory=list)
    keys: list[tuple[int, int]] = field(default_factory=list)  # (seed, position) of each seeded row

    @property
    def changes_logits(self) -> bool:
        """Whether penalties or min_tokens change some logits."""
        return bool(self.repetition.rows or self.output.rows or self.blocked.rows)

    def add(self, request: Request, blocked: list[int]) -> None:
        row = len(self.requests)
        self.requests.append(request)
        params = request.sampling_params
        if params.repetition_penalty != 1.0:
            self.repetition.add(row, request.all_token_ids)
        if params.presence_penalty or params.frequency_penalty:
            self.output.add(row, request.output_token_ids)
        if blocked:
            self.blocked.add(row, blocked)
        if params.greedy:
            self.greedy_rows.append(row)
        elif params.seed is None:
            self.unseeded_rows.append(row)
        else:
            self.seeded_rows.append(row)
            self.keys.append((params.seed, request.num_tokens))  # the position of the token it samples


class Sampler:
    def __init__(self, seed: int) -> None:
        self._generators = Generators(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """logits: [num_requests, vocab] float32, one row per request.

        A request whose own parameters fail (e.g. a stop id outside the vocabulary) is left out
        (in `errors`) before the shared generator is drawn from, so the others sample exactly as they
        would have without it.
        """
        if all(r.plain_greedy for r in requests):
            return SampleResult(ops.argmax_rows(logits).tolist())
        plan, errors = _plan(requests, logits.shape[-1])
        if errors:
            failed = {id(r) for r, _ in errors}
            logits = logits[[row for row, r in enumerate(requests) if id(r) not in failed]]
        token_ids = self._sample_plan(logits, plan) if plan.requests else []
        rows = _logprobs(logits, plan.requests, token_ids)
        if not errors:
            return SampleResult([*token_ids], rows)
        kept = {id(r): i for i, r in enumerate(plan.requests)}  # position among the kept requests
        positions = [kept.get(id(r)) for r in requests]
        if rows is not None:  # back to positions among all the requests
            index_of = {i: position for position, i in enumerate(positions) if i is not None}
            rows.positions = [index_of[i] for i in rows.positions]
        return SampleResult([None if i is None else token_ids[i] for i in positions], rows, errors)

    def _sample_plan(self, logits: torch.Tensor, plan: _Plan) -> list[int]:
        if len(plan.greedy_rows) == len(plan.requests) and not plan.changes_logits:
            return ops.argmax_rows(logits).tolist()
        # Sampled rows first, unseeded ones leading so that one draw fills their noise, then greedy.
        order = plan.unseeded_rows + plan.seeded_rows + plan.greedy_rows
        logits = _penalised(logits, plan, order)  # [n, vocab], a copy, rows in `order`
        num_sampled = len(order) - len(plan.greedy_rows)
        token_ids = ops.argmax_rows(logits[num_sampled:])
        if num_sampled:
            params = [plan.requests[row].sampling_params for row in order[:num_sampled]]
            token_ids = torch.cat([self._sample_rows(logits[:num_sampled], params, plan.keys), token_ids])
        # Back to plan order: token_ids[i] belongs to plan row order[i].
        order_t = torch.tensor(order, device=token_ids.device)
        return torch.empty_like(token_ids).index_copy_(0, order_t, token_ids).tolist()

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], keys: list[tuple[int, int]]
    ) -> torch.Tensor:
        """logits [s, vocab] (overwritten) -> [s] token ids; keys: the (seed, position) of the last
        len(keys) rows, the seeded ones. The leading unseeded rows' exponential noise is one draw from
        the shared generator (on CPU the same numbers as one draw per row); each seeded row's comes
        from its key."""
        probs = _filtered_probs(logits, params)
        noise = torch.empty_like(probs)
        num_unseeded = len(params) - len(keys)
        if num_unseeded:
            noise[:num_unseeded].exponential_(generator=self._generators.shared(probs.device))
        for row, (seed, position) in enumerate(keys, num_unseeded):
            noise[row].exponential_(generator=self._generators.keyed(probs.device, seed, position))
        return ops.sample_from(probs, noise)


def _plan(requests: list[Request], vocab: int) -> tuple[_Plan, list[tuple[Request, Exception]]]:
    plan = _Plan()
    errors: list[tuple[Request, Exception]] = []
    for request in requests:
        try:
            blocked = _blocked_token_ids(request, vocab)
        except Exception as e:  # isolation boundary: this request's parameters, not the batch
            log.exception("sampling setup failed for request %s", request.request_id)
            errors.append((request, e))
            continue
        plan.add(request, blocked)
    return plan, errors


def _blocked_token_ids(request: Request, vocab: int) -> list[int]:
    """Until min_tokens are out, EOS and stop token ids cannot be sampled."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    blocked = set(params.stop_token_ids)
    if not params.ignore_eos:
        blocked |= request.eos_token_ids
    outside = [t for t in blocked if t >= vocab]
    if outside:
        raise IndexError(f"stop token ids {sorted(outside)[:5]} are outside the vocabulary of {vocab} tokens")
    return sorted(blocked)


def _penalised(logits: torch.Tensor, plan: _Plan, order: list[int]) -> torch.Tensor:
    """A copy of logits' rows in `order` [n, vocab], with penalties and min_tokens blocking applied
    (the raw logits stay for the logprobs)."""
    device, dtype = logits.device, logits.dtype
    order_t = torch.tensor(order, device=device)
    logits = logits.clone() if order == list(range(len(order))) else logits.index_select(0, order_t)
    if not plan.changes_logits:
        return logits
    position = torch.empty_like(order_t)
    position[order_t] = torch.arange(len(order), device=device)  # plan row -> row of the copy
    params = [plan.requests[row].sampling_params for row in order]
    if plan.repetition.rows:
        rows, token_ids = plan.repetition.tensors(device)
        penalties = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=device)
        ops.apply_repetition_penalty(logits, position[rows], token_ids, penalties)
    if plan.output.rows:
        rows, token_ids = plan.output.tensors(device)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)
        ops.apply_presence_frequency(logits, position[rows], token_ids, presence, frequency)
    if plan.blocked.rows:
        rows, token_ids = plan.blocked.tensors(device)
        ops.block_tokens(logits, position[rows], token_ids)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [s, vocab] of the sampled rows (overwritten) and their params -> probabilities after
    temperature, top-k, top-p and min-p, each filter over the rows that set it."""
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]
    logits.div_(torch.tensor([p.temperature for p in params], dtype=dtype, device=device)[:, None])
    top_k = _Filter.of(p.top_k if p.top_k is not None and p.top_k < vocab else None for p in params)
    if top_k.rows:
        ops.apply_top_k(
            logits,
            top_k.row_tensor(len(params), device),
            top_k.value_tensor(device, torch.int64),
            int(max(top_k.values)),
        )
    probs = torch.softmax(logits, dim=-1)
    top_p = _Filter.of(p.top_p if p.top_p < 1.0 else None for p in params)
    any_min_p = any(p.min_p > 0.0 for p in params)
    if top_p.rows or any_min_p:
        ops.apply_top_p_min_p(
            probs,
            top_p.row_tensor(len(params), device),
            top_p.value_tensor(device, dtype) if top_p.rows else None,
            torch.tensor([p.min_p for p in params], dtype=dtype, device=device) if any_min_p else None,
        )
    return probs


def _logprobs(raw: torch.Tensor, requests: list[Request], token_ids: list[int]) -> LogprobsRows | None:
    """Logprobs of the raw logits [n, vocab] for the requests that ask, all rows at once."""
    positions = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not positions:
        return None
    index = torch.tensor(positions, device=raw.device)
    logprobs = torch.log_softmax(raw if len(positions) == len(requests) else raw[index], dim=-1)
    num_top = [requests[i].sampling_params.logprobs or 0 for i in positions]
    tokens = [token_ids[i] for i in positions]
    sampled = logprobs.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0]
    top = logprobs.topk(max(num_top), dim=-1)
    return LogprobsRows(
        [requests[i].request_id for i in positions],
        positions,
        tokens,
        sampled.cpu(),
        top.indices.cpu(),
        top.values.cpu(),
        num_top,
    )
