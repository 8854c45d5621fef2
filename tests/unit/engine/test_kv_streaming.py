"""Layer-by-layer KV streaming on the prefill side, at the engine: the blocks of a prompt's last step
are handed out before its forward, each layer is readable once written (and not before), the
blocks belong to the sender from then on (no lease, an abort or a failed step does not free them),
and a failed step fails the readers still waiting. The whole handoff, streamed, is in
test_handoff.py (in process) and test_disagg.py (real workers, gloo)."""

from __future__ import annotations

import threading
import time
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import held_reader
from splitserve.services.engine.layer_progress import LayerProgress, StepFailed
from splitserve.services.engine.ranks import Message, Op, _Follower, decode, encode, step_arrays_to_wire
from splitserve.services.engine.step_inputs import StepArrays

PROMPT = [(7 * j) % 290 + 3 for j in range(37)]  # 5 blocks of 8


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    cache = CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    return Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, cache=cache))


def _all_free(engine: Engine) -> bool:
    return (
        engine.kv.num_free_blocks == engine.runner.num_blocks
        and not engine.has_unfinished_requests()
        and not engine.scheduler.held
    )


class Reader:
    """A sender's side, on its own thread: reads each layer's rows of the streamed blocks as soon as
    they are written, and notes how many layers the step had written by then."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_ids: list[int] = []
        self.heads = range(engine.runner.arch.num_kv_heads)  # every head: whole blocks
        self.seen_done: list[int] = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.out: torch.Tensor | None = None

    def __call__(self, block_ids: list[int], layers: LayerProgress) -> None:  # on the step thread
        runner = self.engine.runner
        self.block_ids = block_ids
        self.out = torch.empty_like(runner.read_heads(block_ids, self.heads))
        fill = held_reader(runner, block_ids, self.heads, self.out, layers)
        self.thread = threading.Thread(target=self._read, args=(fill, layers))
        self.thread.start()

    def _read(self, fill, layers: LayerProgress) -> None:
        try:
            for layer in range(layers.num_layers):
                fill(slice(2 * layer, 2 * layer + 2))
                self.seen_done.append(layers.num_done)
        except StepFailed as e:
            self.error = e

    def join(self) -> None:
        assert self.thread is not None, "the engine never started the stream"
        self.thread.join(10)


def _slow_layers(monkeypatch, seconds: float) -> None:
    """Every layer's forward ends seconds after its KV is marked written (a long layer)."""
    mark = LayerProgress.layer_done

    def slow(self, index: int) -> None:
        mark(self, index)
        time.sleep(seconds)

    monkeypatch.setattr(LayerProgress, "layer_done", slow)


def _streamed(engine: Engine, reader: Reader, prompt=PROMPT) -> str:
    request = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), stop_after_prefill=True)
    request.kv_stream = reader
    return engine.add_request(request)


def _step_to_the_end(engine: Engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_each_layer_is_read_as_soon_as_written_and_equals_the_cache(engine, monkeypatch):
    _slow_layers(monkeypatch, 0.2)
    reader = Reader(engine)
    rid = _streamed(engine, reader)
    (out,) = _step_to_the_end(engine)
    reader.join()
    num_layers = engine.runner.arch.num_layers
    assert reader.error is None and len(reader.seen_done) == num_layers
    assert reader.seen_done[0] < num_layers, "layer 0 was read only after the whole forward"
    assert out.handoff is not None and list(out.handoff.block_ids) == reader.block_ids
    assert torch.equal(reader.out, engine.runner.read_heads(reader.block_ids, reader.heads))
    # The sender owns the blocks: no lease to claim, and they stay out of the pool until it releases.
    assert not engine.claim_held(rid) and engine.num_held_blocks() == len(reader.block_ids)
    assert not engine.abort_request(rid) and engine.num_held_blocks() == len(reader.block_ids)
    assert engine.expire_leases(now=time.monotonic() + 1e6) == 0
    assert engine.release_held(rid) and _all_free(engine)


def test_a_failed_step_fails_the_readers_it_owes_and_keeps_the_blocks_for_the_sender(engine, monkeypatch):
    last = engine.runner.model.layers[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(last, "forward", broken)
    reader = Reader(engine)
    rid = _streamed(engine, reader, PROMPT[:20])
    (out,) = _step_to_the_end(engine)
    reader.join()
    monkeypatch.undo()
    assert out.finished and "illegal memory access" in out.error
    assert isinstance(reader.error, StepFailed)
    assert len(reader.seen_done) == engine.runner.arch.num_layers - 1  # the layers written were read
    assert engine.num_held_blocks() == len(reader.block_ids)  # its sender may still be reading them
    assert engine.release_held(rid) and _all_free(engine)


def test_a_prompt_ending_on_a_one_token_step_is_streamed_too(engine):
    """With the rest of the prompt cached, its last step computes one token (scheduled as a decode)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(PROMPT[:33], params)  # 4 full blocks cached
    _step_to_the_end(engine)
    reader = Reader(engine)
    rid = _streamed(engine, reader, PROMPT[:33])
    _step_to_the_end(engine)
    reader.join()
    assert reader.error is None and len(reader.block_ids) == 5
    assert torch.equal(reader.out, engine.runner.read_heads(reader.block_ids, reader.heads))
    assert engine.release_held(rid) and _all_free(engine)


def test_layer_progress_wakes_each_waiter_at_its_layer():
    layers = LayerProgress(3, torch.device("cpu"))
    woke: list[tuple[int, int]] = []

    def wait(n: int) -> None:
        layers.wait(n)
        woke.append((n, layers.num_done))

    threads = [threading.Thread(target=wait, args=(n,)) for n in (3, 1)]
    for t in threads:
        t.start()
    for index in range(3):
        time.sleep(0.05)
        layers.layer_done(index)
    for t in threads:
        t.join(5)
    assert len(woke) == 2 and all(done >= n for n, done in woke)
    assert dict(woke)[1] < 3  # woken at its layer, not at the end
    layers.wait(0)  # nothing to wait for
    failed = LayerProgress(2, torch.device("cpu"))
    failed.layer_done(0)
    failed.fail(RuntimeError("boom"))
    failed.wait(1)  # written before the failure: still readable
    with pytest.raises(StepFailed, match="boom"):
        failed.wait(2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_reader_on_a_side_stream_waits_for_the_layer_on_cuda():
    """On CUDA a layer counts as written once queued: the reader's stream must wait for its kernels."""
    device = torch.device("cuda")
    kv = torch.zeros(1 << 20, device=device)
    layers = LayerProgress(1, device)
    torch.cuda._sleep(100_000_000)  # keeps the compute stream busy well past the reader's start
    kv.fill_(1.0)
    layers.layer_done(0)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        layers.wait(1)
        read = kv.clone()
    side.synchronize()
    assert bool((read == 1).all())


class _Runner:
    """A follower's runner as _Follower uses it: the steps it is given, with their progress."""

    arch = SimpleNamespace(num_layers=2)
    device = torch.device("cpu")

    def __init__(self, fail: bool = False) -> None:
        self.steps: list[LayerProgress | None] = []
        self.fail = fail

    def follow_step(self, arrays, layers: LayerProgress | None = None) -> None:
        self.steps.append(layers)
        if layers is not None:
            layers.layer_done(0)
        if self.fail:
            raise RuntimeError("a collective timed out")
        if layers is not None:
            layers.layer_done(1)


class _Agent:
    def __init__(self) -> None:
        self.orders: list[tuple[Op, LayerProgress | None]] = []

    def submit(self, order: Message, layers: LayerProgress | None = None) -> None:
        self.orders.append((Op(order.kind), layers))


def _step_order() -> Message:
    arrays = StepArrays(*(np.zeros(1, dtype=np.int64) for _ in fields(StepArrays)))
    return decode(encode(Op.STEP, *step_arrays_to_wire(arrays)))


def test_a_follower_streams_from_the_step_right_after_the_order():
    """STREAM_KV orders come just before the STEP that computes their blocks: that step, and only
    it, marks its layers in the progress every such order's send waits on."""
    runner, agent = _Runner(), _Agent()
    follower = _Follower(runner, agent)  # type: ignore[arg-type]
    follower.carry_out(decode(encode(Op.STREAM_KV, np.array([1]))))
    follower.carry_out(decode(encode(Op.STREAM_KV, np.array([2]))))  # a second request in the same step
    follower.carry_out(decode(encode(Op.SEND_KV, np.array([3]))))  # an unstreamed send: no progress
    follower.carry_out(_step_order())
    follower.carry_out(_step_order())
    (first, a), (second, b), (plain, none) = agent.orders
    assert (first, second, plain) == (Op.STREAM_KV, Op.STREAM_KV, Op.SEND_KV)
    assert a is b and none is None
    assert runner.steps == [a, None]  # the next step marks it, the one after does not
    assert a.num_done == 2


def test_a_followers_failed_step_fails_the_sends_waiting_on_it():
    runner, agent = _Runner(fail=True), _Agent()
    follower = _Follower(runner, agent)  # type: ignore[arg-type]
    follower.carry_out(decode(encode(Op.STREAM_KV, np.array([1]))))
    with pytest.raises(RuntimeError, match="collective"):
        follower.carry_out(_step_order())
    ((_, layers),) = agent.orders
    layers.wait(1)  # written before the failure
    with pytest.raises(StepFailed, match="collective"):
        layers.wait(2)
