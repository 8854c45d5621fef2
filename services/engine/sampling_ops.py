"""Batched sampling ops on the logits' device, beside the per-row `*_ref` they must equal.

Each op takes its per-row parameters as tensors and touches only the rows that use it (`rows`
index tensors built once per step on the host), so a step costs a fixed number of tensor ops
whatever the batch size. Penalties and min_tokens blocking are sparse: they read and write only
the (row, token id) pairs they concern. On CPU the ops give bit-identical values to the per-row
reference, except that top-p keeps every token tied with its last one, where the reference's sort
order decides (tests/unit/engine/test_sampler_batched.py compares values bit for bit and tokens one for one).
On CUDA, top-p reads back which rows its partial sort settled (one synchronisation).

The `*_ref` functions are the per-row sampler this replaced, kept as the reference for tests and
for the sampler benchmark.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.services.engine.request import Request


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, penalties: torch.Tensor
) -> None:
    """In place. logits [n, vocab]; rows, token_ids [m] int64: row rows[i] has seen token_ids[i]
    (duplicates allowed: they write the same value); penalties [n] float32.

    As transformers does: a seen token's positive logit is divided, a negative one multiplied."""
    scores = logits[rows, token_ids]  # [m]
    p = penalties[rows]
    logits[rows, token_ids] = torch.where(scores < 0, scores * p, scores / p)


def apply_presence_frequency(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """In place. rows, token_ids [m] int64: one pair per output token (repeats count);
    presence, frequency [n] float32. As OpenAI does: logit -= frequency * count + presence."""
    vocab = logits.shape[-1]
    keys, counts = torch.unique(rows * vocab + token_ids, return_counts=True)  # one key per distinct pair
    r, t = keys // vocab, keys % vocab
    logits[r, t] -= frequency[r] * counts.to(logits.dtype) + presence[r]


def block_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place: row rows[i] cannot sample token_ids[i] (EOS and stop ids before min_tokens)."""
    logits[rows, token_ids] = float("-inf")


def apply_top_k(logits: torch.Tensor, rows: torch.Tensor | None, top_k: torch.Tensor, max_top_k: int) -> None:
    """In place. logits [s, vocab]; rows [a]: the rows with a top-k (None: all), top_k [a] their k.
    Keeps each such row's k best logits (ties with the k-th included). max_top_k is top_k's
    maximum, given by the caller so that the device is not asked for it."""
    sub = logits if rows is None else logits[rows]  # [a, vocab]
    kth = sub.topk(max_top_k, dim=-1).values.gather(1, (top_k - 1)[:, None])  # [a, 1]
    mask_below(logits, _per_row(kth, rows, logits.shape[0], float("-inf")), float("-inf"))


def apply_top_p_min_p(
    probs: torch.Tensor,
    rows: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    num_candidates: int = 1024,
) -> None:
    """In place, both filters in one pass. probs [s, vocab]; rows [a]: the rows with a top-p
    (None: all), top_p [a] (None: no row has one); min_p [s] (0 where none; None: no row has one).

    top-p keeps in each such row the smallest set of most likely tokens whose mass reaches top_p
    (ties with the last one included); min-p then drops the tokens less likely than min_p times the
    row's best (which top-p keeps): together, the tokens below the larger of the two thresholds."""
    best = probs.amax(dim=-1, keepdim=True)  # [s, 1]
    threshold = torch.zeros_like(best)  # probabilities are >= 0: a row without filters keeps all
    if top_p is not None:
        threshold = _per_row(_top_p_threshold(probs, rows, top_p, best, num_candidates), rows, len(best), 0.0)
    if min_p is not None:
        threshold = torch.maximum(threshold, min_p[:, None] * best)
    mask_below(probs, threshold, 0.0)


def _top_p_threshold(
    probs: torch.Tensor, rows: torch.Tensor | None, top_p: torch.Tensor, best: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """The smallest probability each top-p row keeps [a, 1]. Looked for among the row's
    num_candidates best tokens (a partial sort) when those can reach the mass, else (a flat row)
    among all its tokens (a whole sort)."""
    sub = probs if rows is None else probs[rows]  # [a, vocab]
    vocab = probs.shape[-1]
    k = min(num_candidates, vocab)
    hopeful = (best[:, 0] if rows is None else best[rows, 0]) * k >= top_p  # k tokens reach at most k x best
    partial = hopeful.nonzero()[:, 0]
    threshold = torch.empty(len(sub), 1, dtype=probs.dtype, device=probs.device)
    if len(partial):
        threshold[partial], covered = _threshold_among(_take(sub, partial), top_p[partial], k)
        hopeful[partial[~covered]] = False
    whole = (~hopeful).nonzero()[:, 0]
    if len(whole):
        threshold[whole] = _threshold_among(_take(sub, whole), top_p[whole], vocab)[0]
    return threshold


def _threshold_among(probs: torch.Tensor, top_p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Among each row's k best tokens: the smallest probability top-p keeps [a, 1], and whether
    they reach the mass [a] (if not, a token past them would be kept and the threshold is wrong)."""
    whole = k >= probs.shape[-1]  # a sort is faster than topk for all of them
    ranked = probs.sort(dim=-1, descending=True).values if whole else probs.topk(k, dim=-1).values  # [a, k]
    cumulative = ranked.cumsum(dim=-1)
    kept = cumulative - ranked < top_p[:, None]  # the mass before the token has not reached top_p
    threshold = ranked.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
    return threshold, cumulative[:, -1] >= top_p


def mask_below(x: torch.Tensor, threshold: torch.Tensor, fill: float) -> None:
    """In place: the entries of x [s, vocab] below their row's threshold [s, 1] become fill."""
    x.masked_fill_(x < threshold, fill)


def _per_row(values: torch.Tensor, rows: torch.Tensor | None, num_rows: int, default: float) -> torch.Tensor:
    """values [a, 1] of the listed rows -> [num_rows, 1], default elsewhere."""
    if rows is None:
        return values
    full = torch.full((num_rows, 1), default, dtype=values.dtype, device=values.device)
    full[rows] = values
    return full


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x if len(rows) == len(x) else x[rows]  # every row, in order: no copy


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws each row's token with its
    probability p. probs (overwritten), noise [s, vocab] -> [s] int64."""
    return argmax_rows(probs.div_(noise))


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, vocab] -> [n] int64: each row's first maximum (NaN counts as the maximum), as
    torch.argmax. On CPU through numpy, whose argmax is ~7x faster than torch's on one thread
    (86 vs 11 us at 256 x 320, 11 vs 1.6 ms at 256 x 49152)."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and x.dim() == 2 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=1))
    return x.argmax(dim=-1)


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for its token at `position` (0-based index in
    prompt + output): SplitMix64's output for the counter `position` of a stream keyed by `seed`, so
    nearby positions and seeds give unrelated streams. Any uint64 seed; the values are pinned by a
    test, as every worker must draw the same numbers for the same token."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# -- the per-row reference ----------------------------------------------------------------------


class RefGenerators:
    """The per-row reference sampler's generators: one shared for the unseeded requests; a seeded
    request's draw comes from a generator keyed by (seed, position), as the batched sampler's."""

    def __init__(self, seed: int) -> None:
        self.shared = torch.Generator().manual_seed(seed)  # on CPU: the reference samples there

    def __call__(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.shared
        return torch.Generator().manual_seed(noise_seed(seed, request.num_tokens))


def sample_tokens_ref(
    logits: torch.Tensor, requests: list[Request], generator_for: Callable[[Request], torch.Generator]
) -> list[int]:
    """The per-row sampler: penalties, min_tokens blocking, then greedy or one draw per row.

    generator_for gives a seeded request its own generator and the others one shared generator."""
    logits = logits.clone()
    for row, request in enumerate(requests):
        apply_penalties_ref(logits[row], request)
        block_stop_tokens_ref(logits[row], request)
    return [sample_row_ref(logits[row], request, generator_for) for row, request in enumerate(requests)]


def sample_row_ref(row: torch.Tensor, request: Request, generator_for: Callable[[Request], torch.Generator]) -> int:
    params = request.sampling_params
    if params.greedy:
        return int(row.argmax())
    probs = filtered_probs_ref(row.cpu() / params.temperature, params.top_k, params.top_p, params.min_p)
    noise = torch.empty_like(probs).exponential_(generator=generator_for(request))
    return int((probs / noise).argmax())


def apply_penalties_ref(row: torch.Tensor, request: Request) -> None:
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


def block_stop_tokens_ref(row: torch.Tensor, request: Request) -> None:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return
    blocked = set(params.stop_token_ids)
    if not params.ignore_eos:
        blocked |= request.eos_token_ids
    if blocked:
        row[torch.tensor(sorted(blocked), dtype=torch.int64, device=row.device)] = float("-inf")


def filtered_probs_ref(logits: torch.Tensor, top_k: int | None, top_p: float, min_p: float) -> torch.Tensor:
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
