"""The CPU decode path's mirror (contiguous K/V copies kept across steps) against a dense reference and
the paged gather, over steps whose batches change: sequences join, leave, come back recomputed, grow
past the buffer, and a step fails between layers."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from splitserve.services.model.attention.backend import AttentionMetadata
from splitserve.services.model.attention.decode_mirror import padded_tokens, slot_ranges
from splitserve.services.model.attention.torch_backend import TorchAttention

H, KVH, D, BS, NUM_BLOCKS, LAYERS = 4, 2, 8, 4, 1024, 2


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode query [h, d] over its whole context k, v [L, kvh, d] -> [h, d]."""
    k, v = (t.repeat_interleave(H // KVH, dim=1).transpose(0, 1) for t in (k, v))  # [h, L, d]
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]


class _Cluster:
    """Sequences with their true K/V per layer, laid out in a paged cache the way an engine would."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.caches = [torch.zeros(2, NUM_BLOCKS, BS, KVH, D) for _ in range(LAYERS)]
        self.free = list(range(1, NUM_BLOCKS))  # block 0: a padded row's
        self.rng.shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per layer [L, kvh, d] each

    def add(self, sid: int, length: int) -> None:
        """A sequence whose first length tokens are in the cache (a prompt computed by a prefill)."""
        self.blocks[sid] = []
        self.kv[sid] = [(torch.randn(length, KVH, D), torch.randn(length, KVH, D)) for _ in range(LAYERS)]
        self._write_all(sid)

    def recompute(self, sid: int) -> None:
        """Preempted and recomputed: same length, new values (another batch shape rounds differently)."""
        self.kv[sid] = [(torch.randn_like(k), torch.randn_like(v)) for k, v in self.kv[sid]]
        self._write_all(sid)

    def _write_all(self, sid: int) -> None:
        length = len(self.kv[sid][0][0])
        while len(self.blocks[sid]) * BS < length:
            self.blocks[sid].append(self.free.pop())
        for cache, (k, v) in zip(self.caches, self.kv[sid]):
            for p in range(length):
                block = self.blocks[sid][p // BS]
                cache[0, block, p % BS], cache[1, block, p % BS] = k[p], v[p]

    def step(self, sids: list[int], seq_ids: bool = True):
        """One decode token for each of sids (in that batch order): its metadata, new K/V and queries per layer."""
        slots, lens = [], []
        for sid in sids:
            length = len(self.kv[sid][0][0]) + 1
            if len(self.blocks[sid]) * BS < length:
                self.blocks[sid].append(self.free.pop())
            slots.append(self.blocks[sid][(length - 1) // BS] * BS + (length - 1) % BS)
            lens.append(length)
        width = max(len(self.blocks[s]) for s in sids)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in sids]),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.arange(len(sids) + 1, dtype=torch.int32),
            num_decodes=len(sids),
            max_seq_len=max(lens),
            seq_lens_cpu=lens,
            query_lens_cpu=[1] * len(sids),
            decode_seq_ids=list(sids) if seq_ids else None,
        )
        layers = []
        for layer in range(LAYERS):
            new_k, new_v = torch.randn(len(sids), KVH, D), torch.randn(len(sids), KVH, D)
            for i, sid in enumerate(sids):
                k, v = self.kv[sid][layer]
                self.kv[sid][layer] = (torch.cat([k, new_k[i : i + 1]]), torch.cat([v, new_v[i : i + 1]]))
            layers.append((torch.randn(len(sids), H, D), new_k, new_v))
        return meta, layers

    def expected(self, sids: list[int], layer: int, q: torch.Tensor) -> torch.Tensor:
        return torch.stack([_dense(q[i], *self.kv[sid][layer]) for i, sid in enumerate(sids)])


def _run(backend: TorchAttention, cluster: _Cluster, sids: list[int], layers: int = LAYERS, **kw) -> None:
    meta, inputs = cluster.step(sids, **kw)
    for layer, (q, k, v) in list(enumerate(inputs))[:layers]:
        out = backend.forward(q, k, v, cluster.caches[layer], meta)
        torch.testing.assert_close(out, cluster.expected(sids, layer, q), rtol=1e-5, atol=1e-5)


def test_mirrored_decodes_match_dense_as_batches_change():
    torch.manual_seed(0)
    cluster, backend = _Cluster(0), TorchAttention(H, KVH, D, BS)
    for sid, length in enumerate([3, 17, 9, 30, 1, 12]):
        cluster.add(sid, length)
    plan = [
        [0, 1, 2, 3],  # all filled
        [0, 1, 2, 3],  # all appended, same order
        [3, 1, 0, 2],  # reordered: queries permuted into slot order
        [3, 1, 4],  # 0 and 2 left, 4 joins; 3's slot stays, 1 keeps its own, 4 takes a freed one
        [5, 4, 1, 3, 0],  # 0 comes back (a fill, not its old copy), 5 joins
        [4, 5],  # 1, 3, 0 leave: 4 and 5 moved down into slots 0-1
        [4, 5],
    ]
    for sids in plan:
        _run(backend, cluster, sids)
        assert backend._plan.mirror is not None
    # grown past the first buffer's capacity (several reallocations, content carried)
    for _ in range(40):
        _run(backend, cluster, [4, 5])
    assert backend._plan.mirror.carried_from is not None and backend._plan.mirror.moves is None


def test_a_sequence_absent_for_a_step_is_refilled_not_trusted():
    """Preempted at one step and recomputed (new K/V in the paged cache): its old copy must not be read."""
    torch.manual_seed(1)
    cluster, backend = _Cluster(1), TorchAttention(H, KVH, D, BS)
    cluster.add(0, 10)
    cluster.add(1, 20)
    _run(backend, cluster, [0, 1])
    _run(backend, cluster, [1])  # 0 preempted
    cluster.recompute(0)
    _run(backend, cluster, [0, 1])
    _run(backend, cluster, [1, 0])


def test_a_layer_that_missed_a_step_refills():
    """A step that failed after its first layer: the next step's later layers must not carry stale copies."""
    torch.manual_seed(2)
    cluster, backend = _Cluster(2), TorchAttention(H, KVH, D, BS)
    cluster.add(0, 7)
    cluster.add(1, 5)
    _run(backend, cluster, [0, 1])
    meta, inputs = cluster.step([0, 1])
    q, k, v = inputs[0]
    backend.forward(q, k, v, cluster.caches[0], meta)  # layer 1 never runs this step
    for layer, cache in enumerate(cluster.caches[1:], start=1):  # the engine's cache holds what was stored
        cache_view = cache.view(2, -1, KVH, D)
        cache_view[0].index_copy_(0, meta.slot_mapping, inputs[layer][1])
        cache_view[1].index_copy_(0, meta.slot_mapping, inputs[layer][2])
    _run(backend, cluster, [1, 0])


def test_over_budget_or_without_ids_decodes_gather_from_the_paged_cache():
    torch.manual_seed(3)
    cluster = _Cluster(3)
    for sid in range(3):
        cluster.add(sid, 30)
    small = TorchAttention(H, KVH, D, BS, decode_mirror_bytes=2 * 3 * 32 * KVH * D * 4 - 1)
    _run(small, cluster, [0, 1, 2])
    assert small._plan.mirror is None
    backend = TorchAttention(H, KVH, D, BS)
    _run(backend, cluster, [0, 1, 2], seq_ids=False)
    assert backend._plan.mirror is None
    _run(backend, cluster, [0, 1, 2])
    assert backend._plan.mirror is not None and backend._plan.mirror.carried_from is None
    off = TorchAttention(H, KVH, D, BS, decode_mirror_bytes=0)
    _run(off, cluster, [0, 1, 2])
    assert off._plan.mirror is None


def test_buffers_grow_by_doubling_and_then_to_the_budget_not_block_by_block():
    """Each growth is a new buffer per layer and a copy of the old (a stall of every decode on the
    step): the capacity doubles, and once doubling would pass the budget it takes all the budget
    allows, instead of reallocating at every block the sequences grow by; past the budget, the paged
    gather."""
    torch.manual_seed(6)
    cluster = _Cluster(6)
    cluster.add(0, 9)
    cluster.add(1, 5)
    per_token = 2 * KVH * D * 4  # K and V of one token, float32
    backend = TorchAttention(H, KVH, D, BS, decode_mirror_bytes=2 * 40 * per_token)  # 2 slots of 40 tokens
    shapes = []
    for _ in range(32):  # sequence 0 from 10 to 41 tokens
        _run(backend, cluster, [0, 1])
        step = backend._plan.mirror
        shapes.append(None if step is None else step.shape)
    assert sorted(set(shapes[:31]), key=lambda shape: shape[1]) == [(2, 12), (2, 24), (2, 40)]
    assert shapes[31] is None  # 41 tokens: 2 slots of 44 pass the budget


def test_buffers_go_when_a_step_has_no_decodes():
    torch.manual_seed(4)
    cluster, backend = _Cluster(4), TorchAttention(H, KVH, D, BS)
    cluster.add(0, 6)
    _run(backend, cluster, [0])
    assert backend._mirror._buffers
    block = cluster.free.pop()
    prompt = AttentionMetadata(  # a two-token prompt, nothing cached
        slot_mapping=torch.tensor([block * BS, block * BS + 1]),
        block_tables=torch.tensor([[block]]),
        seq_lens=torch.tensor([2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        num_decodes=0,
        max_seq_len=2,
        seq_lens_cpu=[2],
        query_lens_cpu=[2],
        decode_seq_ids=[],
    )
    q, k, v = torch.randn(2, H, D), torch.randn(2, KVH, D), torch.randn(2, KVH, D)
    backend.forward(q, k, v, cluster.caches[0], prompt)
    assert not backend._mirror._buffers


def test_mixed_lengths_attend_in_ranges_sorted_by_length():
    """Lengths mixed along the slots are reassigned by length (the kept copies permuted), then attended
    range by range, each at its own width; sequences joining and leaving keep it exact."""
    torch.manual_seed(5)
    cluster, backend = _Cluster(5), TorchAttention(H, KVH, D, BS)
    lengths = [6, 70] * 10 + [40] * 4
    for sid, length in enumerate(lengths):
        cluster.add(sid, length)
    short_first = list(range(0, 20, 2))
    _run(backend, cluster, list(range(10)))  # mixed along the slots from the start
    _run(backend, cluster, list(range(24)))  # 14 join: a re-sort moves kept copies
    step = backend._plan.mirror
    assert step.carried_from is not None and step.moves is not None and len(step.ranges) > 1
    _run(backend, cluster, list(range(24)))
    _run(backend, cluster, [s for s in range(24) if s not in short_first])  # the short ones leave
    _run(backend, cluster, [23, 1, 21, 3, 22, 5])


def test_slot_ranges_close_on_length_ratio_after_min_size():
    lens = [10] * 8 + [12, 100, 101] + [300] * 8
    assert slot_ranges(lens, ratio=1.5, min_size=8) == [(0, 9), (9, 17), (17, 19)]
    assert slot_ranges([5, 500, 5], min_size=8) == [(0, 3)]  # too few slots to split
    assert padded_tokens([10] * 8 + [300] * 8) == 8 * 10 + 8 * 300
    assert padded_tokens([10, 300] * 8) == 16 * 300
