"""How many workers a tier needs to serve a load within the SLO targets, from a Profile.

Prefill (TTFT). One prefill worker serves mu = Profile.prefill_rate(L) requests/s with full steps of
L-token prompts; a prompt alone takes S = Profile.prefill_request_s(L). The tier needs at least
ceil(rate / (mu * utilisation)) workers, then the smallest n whose predicted TTFT p90
    S + wait_p90(rate / n, mu) + transfer_s + one decode step  <=  ttft target * headroom.
wait_p90 models each worker as M/D/1 (Poisson arrivals, deterministic service 1/mu): the
Pollaczek-Khinchine mean wait Wq = rho / (2 mu (1 - rho)), rho = lambda / mu, with the tail taken as in
M/M/1 (a request waits at all with probability rho, and beyond that exponentially with mean Wq / rho):
    wait_p90 = (Wq / rho) * ln(10 rho)  when rho > 0.1, else 0.
Decode (ITL). The largest batch B whose step at the mean context (L + O / 2) takes at most
itl target * headroom, within max_num_seqs and the KV capacity (B * (L + O) tokens). A worker then makes
B / step(B) tokens/s, and the tier needs ceil(rate * O / (B / step(B) * utilisation)) workers (Little's
law: rate * O * step(B) sequences in flight, B per worker).
Unified (colocated). A worker does both: decoding takes a share of its time, d = rate_w * O * step / B,
and the prompts queue for the rest, mu' = mu * (1 - d); then as prefill, without the transfer.
Prefill chunks slowing the decodes that share their steps (the reason to disaggregate) are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.services.planner.forecast import Load
from splitserve.services.planner.profile import Profile

_QUEUE_FREE_RHO = 0.1  # below this utilisation the p90 request does not wait (P(wait > 0) = rho)


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_s: float  # p90 time to first token
    itl_s: float  # p90 inter-token latency

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLO targets must be > 0, got {self}")


@dataclass(frozen=True, slots=True)
class Sizing:
    utilisation: float = 0.8  # the busiest a worker is planned to be: a queue at 1 grows without bound
    headroom: float = 0.9  # plan for this fraction of each target

    def __post_init__(self) -> None:
        if not (0 < self.utilisation <= 1 and 0 < self.headroom <= 1):
            raise ValueError(f"utilisation and headroom must be in (0, 1], got {self}")


@dataclass(frozen=True, slots=True)
class TierNeed:
    workers: int
    feasible: bool  # False: no number of workers meets the target (the model says a lone request misses it)
    inputs: dict[str, float] = field(default_factory=dict)  # what the sizing computed, for the decision log


def wait_p90_s(arrival_rate: float, service_rate: float) -> float:
    """90th percentile of the wait in an M/D/1 queue (see the module docstring); inf when overloaded."""
    rho = arrival_rate / service_rate
    if rho >= 1:
        return math.inf
    if rho <= _QUEUE_FREE_RHO:
        return 0.0
    mean_wait = rho / (2 * service_rate * (1 - rho))
    return mean_wait / rho * math.log(10 * rho)


def decode_batch(profile: Profile, load: Load, itl_budget_s: float) -> tuple[int, bool]:
    """(largest batch meeting the ITL budget within the worker's limits, whether batch 1 meets it)."""
    context = load.prompt_tokens + load.output_tokens / 2
    a, b, c = profile.decode.coef
    limit = profile.limits.max_num_seqs
    if profile.limits.kv_capacity_tokens is not None:
        limit = min(limit, int(profile.limits.kv_capacity_tokens // max(load.prompt_tokens + load.output_tokens, 1)))
    per_sequence = b + c * context
    batch = limit if per_sequence == 0 else int((itl_budget_s - a) // per_sequence)
    return max(1, min(batch, limit)), profile.decode_step_s(1, context) <= itl_budget_s


def decode_need(load: Load, profile: Profile, targets: SloTargets, sizing: Sizing) -> TierNeed:
    if load.rate <= 0:
        return TierNeed(0, True)
    batch, feasible = decode_batch(profile, load, targets.itl_s * sizing.headroom)
    step_s = profile.decode_step_s(batch, load.prompt_tokens + load.output_tokens / 2)
    tokens_per_s = batch / step_s
    workers = math.ceil(load.rate * max(load.output_tokens, 1) / (tokens_per_s * sizing.utilisation))
    inputs = {"batch": batch, "step_s": step_s, "tokens_per_s_per_worker": tokens_per_s}
    return TierNeed(workers, feasible, inputs)


def prefill_need(
    load: Load, profile: Profile, targets: SloTargets, sizing: Sizing, transfer_s: float = 0.0
) -> TierNeed:
    if load.rate <= 0:
        return TierNeed(0, True)
    batch, _ = decode_batch(profile, load, targets.itl_s * sizing.headroom)
    first_step_s = profile.decode_step_s(batch, load.prompt_tokens)
    budget_s = targets.ttft_s * sizing.headroom - transfer_s - first_step_s
    return _queue_need(load, profile, sizing, budget_s, decode_share=lambda n: 0.0)


def unified_need(load: Load, profile: Profile, targets: SloTargets, sizing: Sizing) -> TierNeed:
    if load.rate <= 0:
        return TierNeed(0, True)
    decode = decode_need(load, profile, targets, sizing)
    step_s = decode.inputs["step_s"]
    decode_work = load.rate * max(load.output_tokens, 1) / decode.inputs["tokens_per_s_per_worker"]

    def decode_share(n: int) -> float:  # of each worker's time
        return decode_work / n

    budget_s = targets.ttft_s * sizing.headroom - step_s
    need = _queue_need(load, profile, sizing, budget_s, decode_share)
    return TierNeed(need.workers, need.feasible and decode.feasible, decode.inputs | need.inputs)


def _queue_need(
    load: Load, profile: Profile, sizing: Sizing, budget_s: float, decode_share: Callable[[int], float]
) -> TierNeed:
    """The prefill queue's size: the utilisation bound, then the TTFT bound (module docstring)."""
    mu = profile.prefill_rate(load.prompt_tokens)
    service_s = profile.prefill_request_s(load.prompt_tokens)
    n = max(1, math.ceil(load.rate / (mu * sizing.utilisation)))
    while decode_share(n) + load.rate / (n * mu) > sizing.utilisation:
        n += 1
    feasible = service_s < budget_s
    if feasible:
        while service_s + wait_p90_s(load.rate / n, mu * (1 - decode_share(n))) > budget_s:
            n += 1  # ends: by rate / n <= 0.1 * mu' the wait is 0
    predicted = service_s + wait_p90_s(load.rate / n, mu * (1 - decode_share(n)))
    inputs = {
        "requests_per_s_per_worker": mu,
        "lone_prompt_s": service_s,
        "ttft_budget_s": budget_s,
        "predicted_ttft_p90_s": predicted,
    }
    return TierNeed(n, feasible, inputs)
