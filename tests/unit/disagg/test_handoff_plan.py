"""The plan of a KV handoff between tensor-parallel tiers (services/disagg/plan.py) for every pair of sizes in
{1, 2, 4} and 1, 2, 4 or 8 KV heads; and the wire of the follower ranks' transfer orders
(services/disagg/rank_transfers.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import numpy as np
import pytest

from splitserve.services.disagg.plan import Piece, check_fits, handoff_plan, heads_of
from splitserve.services.disagg.rank_transfers import (
    PieceReport,
    _ask,
    _result,
    channel_from_wire,
    channel_to_wire,
    failure_to_wire,
    report_from_wire,
    report_to_wire,
)
from splitserve.services.disagg.transfer.base import Backend, ChannelSpec, TransferError, TransferFailure
from splitserve.services.engine.ranks import Message, Op, RanksLost, Status, bytes_array, decode, encode

SIZES = (1, 2, 4)
CASES = [(h, a, b) for h in (1, 2, 4, 8) for a, b in itertools.product(SIZES, SIZES)]


@pytest.mark.parametrize("num_kv_heads,src_size,dst_size", CASES)
def test_every_decode_rank_gets_each_of_its_heads_once_from_a_holder(num_kv_heads, src_size, dst_size):
    plan = handoff_plan(num_kv_heads, src_size, dst_size)
    for dst in range(dst_size):
        got = Counter(h for p in plan if p.dst_rank == dst for h in p.heads)
        assert got == Counter(heads_of(num_kv_heads, dst_size, dst)), (dst, plan)
    for p in plan:
        held = heads_of(num_kv_heads, src_size, p.src_rank)
        assert held.start <= p.heads.start and p.heads.stop <= held.stop, p
    check_fits(plan, num_kv_heads, src_size, dst_size)
    assert len({(p.src_rank, p.dst_rank) for p in plan}) == len(plan)  # one piece (and channel) per pair


def test_plans_are_rank_to_rank_where_the_sizes_are_equal_and_spread_over_replicas():
    assert handoff_plan(2, 1, 1) == [Piece(0, 0, range(0, 2))]  # the whole-block transfer
    assert handoff_plan(8, 2, 2) == [Piece(0, 0, range(0, 4)), Piece(1, 1, range(4, 8))]
    assert handoff_plan(2, 2, 1) == [Piece(0, 0, range(0, 1)), Piece(1, 0, range(1, 2))]
    # 4 prefill ranks over 1 KV head: every rank holds it; the two decode ranks read different ones
    assert handoff_plan(1, 4, 2) == [Piece(0, 0, range(0, 1)), Piece(1, 1, range(0, 1))]
    assert {p.src_rank for p in handoff_plan(2, 4, 4)} == {0, 1, 2, 3}


def test_a_plan_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="outside"):
        check_fits(handoff_plan(2, 2, 1), 2, 1, 1)  # this prefill worker has one rank, not two
    with pytest.raises(ValueError, match="holds KV heads"):
        check_fits([Piece(1, 0, range(0, 2))], 2, 2, 1)  # rank 1 of 2 holds head 1 only
    with pytest.raises(ValueError, match="neither divides"):
        handoff_plan(3, 2, 1)


def test_orders_and_replies_carry_ints_and_bytes():
    channel = ChannelSpec("10.0.0.7:29500", "c0ffee", bytes(range(32)), Backend.NCCL)
    block_ids = np.array([3, 9, 4])
    message = decode(encode(Op.SEND_KV, *channel_to_wire(channel), np.array([5, 0, 1]), block_ids, number=42))
    assert (Op(message.kind), message.number) == (Op.SEND_KV, 42)
    assert channel_from_wire(*message.arrays[:4]) == channel  # the secret too, byte for byte
    assert message.arrays[5].tolist() == [3, 9, 4] and message.arrays[0].dtype == np.uint8
    report = PieceReport(4096, 0xFFFFFFFFFFFFFFFF, 0.25)  # a 64-bit checksum (XXH3-64)
    reply = decode(encode(Status.OK, *report_to_wire(report), number=42))
    assert report_from_wire(_result(reply)) == report
    failed = decode(encode(Status.FAILED, *failure_to_wire(TransferError(TransferFailure.TIMEOUT, "slow")), number=1))
    with pytest.raises(TransferError, match="slow") as e:
        _result(failed)
    assert e.value.reason is TransferFailure.TIMEOUT
    assert decode(encode(Op.STOP)) == Message(Op.STOP, 0, [])
    assert decode(encode(Op.KV_CHANNEL, bytes_array(b""))).arrays[0].shape == (0,)


def test_an_order_to_a_lost_rank_fails_as_a_transfer_error():
    class LostPort:
        async def ask_rank(self, rank, op, *arrays):
            raise RanksLost("tensor-parallel rank tp-rank-1 exited (-9)")

    with pytest.raises(TransferError) as e:
        asyncio.run(_ask(LostPort(), 1, Op.RECV_KV))  # type: ignore[arg-type]
    assert e.value.reason is TransferFailure.PEER_LOST
