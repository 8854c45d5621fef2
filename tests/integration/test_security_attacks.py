"""Issue 35 items 3, 5 and 6: the KV plane against another local user. Each test is the attack; the
attackers run as user nobody where the machine allows it (tests/as_user.py, tests/kv_attacks.py).
A test marked xfail(strict=True) is an attack that still succeeds (NOT HELD in `make security-check`);
it fails loudly once someone fixes it, so the mark comes off with the fix. Workers run gloo and the
store in a KV agent process (services/disagg/transfer/isolated.py): the attacks that kill gloo or fill the
store end the agent, whose worker starts another, and fail the transfers on it (their requests
recompute); the victims here are agents."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import torch
from as_user import spawn_as_nobody
from kv_attacks import SHAPE, move_once

from splitserve.services.disagg.transfer.isolated import AGENT_DATA_BYTES, AgentReceiver, AgentSender
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

TIMEOUT_S = 5.0
BOUND_S = 60.0  # an upper bound that only a broken run reaches


# --- item 5: the store keeps no channel's keys --------------------------------------------------


# --- item 6: gloo's address records carry none of the process's memory ---------------------------


# --- the store, from another user --------------------------------------------------------------


def _run(attacker) -> dict:
    out, _ = attacker.communicate(timeout=BOUND_S)
    return json.loads(out.strip().splitlines()[-1])


def test_another_user_reading_the_store_after_a_transfer_finds_nothing():
    receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
    try:
        asyncio.run(move_once(receiver, sender))
        assert _run(spawn_as_nobody("kv_attacks.py", "read-store", receiver.address)) == {}
    finally:
        receiver.close(), sender.close()


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


async def _move_on_a_fresh_channel(receiver: AgentReceiver, sender: AgentSender, attempts: int = 3) -> int:
    """Moves one transfer as the decode worker does after a failed handoff: a new channel each time;
    returns how many attempts failed."""
    for failed in range(attempts):
        channel = receiver.channel_for("prefill-a")
        buffer, data, tag = torch.zeros(SHAPE), torch.randn(SHAPE), receiver.next_tag(channel)
        ends = await asyncio.gather(
            receiver.recv(channel, tag, buffer), sender.send(channel, tag, data), return_exceptions=True
        )
        if not any(isinstance(end, BaseException) for end in ends):
            assert torch.equal(buffer, data)
            return failed
        receiver.drop(channel)
    raise AssertionError(f"no transfer moved in {attempts} attempts: {ends}")


def test_another_user_filling_the_store_costs_the_worker_no_memory_and_transfers_go_on():
    receiver, sender = AgentReceiver(timeout_s=TIMEOUT_S), AgentSender(timeout_s=TIMEOUT_S)
    try:
        agent = receiver.agent.wait_ready(BOUND_S)
        before, num_bytes = _rss_bytes(), 2 * AGENT_DATA_BYTES
        written = _run(spawn_as_nobody("kv_attacks.py", "write-store", receiver.address, str(num_bytes)))
        assert written["written"] < num_bytes, "the store took everything user nobody wrote"
        assert _rss_bytes() - before < 64 << 20, "the store's writes landed in the worker"
        assert asyncio.run(_move_on_a_fresh_channel(receiver, sender)) <= 1  # the full agent's channel, at most
        assert receiver.agent.pid() != agent, "the agent holding the writes still serves"
    finally:
        receiver.close(), sender.close()


# --- item 3: gloo's listener, from another user -------------------------------------------------


def _attack_the_victim(attack: str, count: int) -> tuple[int | None, str]:
    """A worker's transfer pair (tests/kv_attacks.py victim) moves KV once; user nobody attacks the gloo
    listeners its agents then have; the victim moves KV on a new channel. Its exit code and output."""
    script = Path(__file__).parents[1] / "kv_attacks.py"
    victim = subprocess.Popen(
        [sys.executable, str(script), "victim"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    attacker = None
    try:
        assert victim.stdout is not None and victim.stdin is not None
        assert victim.stdout.readline().startswith("warm True"), "the victim moved no KV before the attack"
        ports = victim.stdout.readline().split()[1:]
        assert ports, "the victim listens on no gloo port"
        attacker = spawn_as_nobody("kv_attacks.py", attack, str(count), *ports)
        assert attacker.stdout is not None
        attacker.stdout.readline()  # planted (or stopped: the victim is gone)
        victim.stdin.write("go\n")
        victim.stdin.flush()
        out, _ = victim.communicate(timeout=BOUND_S)
    except BrokenPipeError:  # the victim died before it was told to move KV
        out = ""
        victim.wait(timeout=BOUND_S)
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait()
        if victim.poll() is None:
            victim.kill()
    return victim.returncode, out


def test_idle_connections_to_the_gloo_listener_do_not_kill_the_worker():
    code, out = _attack_the_victim("flood", 1200)  # past the worker's 1024 open files: gloo aborts
    assert code == 0, f"the worker died: exit {code}"
    assert "moved True" in out, f"the worker lives but moved no KV: {out!r}"


def test_connections_planted_on_a_gloo_listener_do_not_fail_later_channels():
    """Each planted connection names one of gloo's pair sequence numbers, as a peer would, so the pair
    that later waits for that number takes it instead of its peer's: on a listener that every channel
    shares, 64 plants fail the next channels' handshakes for as long as the listener lives."""
    code, out = _attack_the_victim("plant", 64)
    assert code == 0, f"the worker died: exit {code}"
    assert out.split()[-3:] == ["moved", "True", "0"], f"the next channel failed: {out!r}"
