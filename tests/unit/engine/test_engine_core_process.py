"""The engine core in its own process (services/engine/core_process.py) behind EngineCoreClient: the same
outputs as the engine in process, refusals that leave it serving, aborts that free blocks, and a
dead core that fails every stream instead of hanging it. Real spawned processes and pipes."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import params_from_proto, params_to_proto
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.core_wire import (
    finishes_from_proto,
    load_from_proto,
    load_to_proto,
    logprobs_from_step_proto,
    step_tokens_to_proto,
)
from splitserve.services.engine.handoff_port import engine_load
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.outputs import Finish, StepTokens
from splitserve.services.engine.request import FinishReason
from splitserve.services.engine.sampler import TokenLogprobs


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    )


@given(
    temperature=st.floats(0, 2),
    top_k=st.none() | st.integers(1, 50),
    seed=st.none() | st.integers(0, 2**64 - 1),  # the public API's seed is uint64: every one of them
    max_tokens=st.none() | st.integers(1, 10**6),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    logprobs=st.none() | st.integers(0, 20),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_sampling_params_cross_the_pipe_whole(temperature, top_k, seed, max_tokens, stop, logprobs, flags):
    params = SamplingParams(
        temperature=temperature,
        top_p=0.5,
        top_k=top_k,
        min_p=0.1,
        seed=seed,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=[3, 5],
        ignore_eos=flags[0],
        logprobs=logprobs,
        skip_special_tokens=flags[1],
        include_stop_str_in_output=flags[2],
    )
    assert params_from_proto(params_to_proto(params)) == params
    assert params_from_proto(params_to_proto(SamplingParams())) == SamplingParams()
    for edge in (2**63 - 1, 2**63, 2**64 - 1):  # every run, whatever the draw
        edged = dataclasses.replace(params, seed=edge)
        assert params_from_proto(params_to_proto(edged)) == edged


@given(seed=st.integers(-(2**63), -1))
def test_a_negative_seed_crosses_the_pipe_as_the_seed_torch_makes_of_it(seed):
    """torch seeds a generator with a negative seed as with seed mod 2^64 (the uint64 the HTTP API
    makes of it too): the pipe carries that, and the core samples what the engine in process would."""
    crossed = params_from_proto(params_to_proto(SamplingParams(seed=seed))).seed
    assert crossed == seed % 2**64
    assert torch.Generator().manual_seed(seed).initial_seed() == torch.Generator().manual_seed(crossed).initial_seed()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused_before_the_pipe(seed):
    with pytest.raises(ValueError, match="seed"):
        params_to_proto(SamplingParams(seed=seed))


def test_a_steps_tokens_cross_the_pipe_whole(tiny_llama_dir):
    """Token ids, first-schedule facts, finishes, logprobs and failures of a real step."""
    engine = LLM(config=_config(tiny_llama_dir)).engine
    a = engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    b = engine.make_request([4, 5], SamplingParams(temperature=0, max_tokens=5))
    for r in (a, b):
        engine.add_request(r)
    engine.scheduler.schedule()  # not stepped: StepTokens as Engine._step_tokens would build them
    lp = TokenLogprobs(9, -0.5, ((9, -0.5), (3, -2.0)))
    step = StepTokens([a, b], [9, 11], {a.request_id: Finish(FinishReason.LENGTH, 9)}, 12.5, {a.request_id: lp})
    step.failed = [(b, "boom")]
    msg = pb.CoreStepTokens.FromString(step_tokens_to_proto(step, ticket=7).SerializeToString())
    assert (msg.ticket, msg.time, list(msg.request_ids), list(msg.token_ids)) == (
        7,
        12.5,
        [a.request_id, b.request_id],
        [9, 11],
    )
    assert list(msg.first_scheduled_times) == [a.first_scheduled_time, b.first_scheduled_time]
    assert finishes_from_proto(msg) == step.finished
    assert logprobs_from_step_proto(msg) == {a.request_id: lp}
    assert [(f.request_id, f.message) for f in msg.failed] == [(b.request_id, "boom")]
    step.logprobs = None
    assert (
        logprobs_from_step_proto(pb.CoreStepTokens.FromString(step_tokens_to_proto(step, 8).SerializeToString()))
        is None
    )


def test_the_load_crosses_the_pipe_whole(tiny_llama_dir):
    engine = LLM(config=_config(tiny_llama_dir)).engine
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    load = engine_load(engine)
    assert load.steps and any(t.num_steps for t in load.steps.values())
    assert load_from_proto(load_to_proto(load)) == load
    assert {f.name for f in dataclasses.fields(load)} >= {"steps", "num_running", "kv_usage"}


def test_a_core_stops_when_its_serving_process_is_gone_even_while_it_waits_for_an_ack(tiny_llama_dir):
    """With a stop string in the batch the step loop waits for the serving process's acknowledgement
    of the step before last. If that process dies meanwhile (its pipe closes), the core must still
    stop, not wait for ever as an orphan. The core runs on a thread here, over a real pipe."""
    import multiprocessing
    import threading

    from splitserve.services.engine.core_process import EngineCore
    from splitserve.services.engine.step_loop import load_engine

    ours, theirs = multiprocessing.Pipe()
    core = EngineCore(load_engine(_config(tiny_llama_dir)), theirs)
    serving = threading.Thread(target=core.serve, daemon=True)
    serving.start()
    assert pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") == "ready"
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=["never in this output"])
    call = wpb.WorkerGenerateRequest(prompt_token_ids=[1, 2, 3], params=params_to_proto(params))
    add = pb.CoreAddRequest(request_id="r", generate=call)
    ours.send_bytes(pb.CoreCommand(add=add).SerializeToString())
    steps = 0
    while steps < 2:  # never acknowledged: the loop now waits for the first step's acknowledgement
        assert ours.poll(10), "the core sent no step"
        steps += pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") == "step_tokens"
    assert not ours.poll(0.5)  # it waits: no third step
    ours.close()
    serving.join(10)
    assert not serving.is_alive(), "the core still waits for an acknowledgement nobody will send"


class _CountingHandoffs:
    """A core's handoffs (services/engine/core_process.py CoreHandoffs) that count into its registry."""

    def __init__(self, engine, steps, send, registry) -> None:
        from prometheus_client import Counter

        self.started = Counter("splitserve_test_handoffs", "Handoffs started.", registry=registry)

    def start(self, request, add) -> None:
        self.started.inc()

    def on_step(self, step) -> None:
        pass

    def close(self) -> None:
        pass


def test_what_a_core_counts_is_read_from_it_at_once(tiny_llama_dir):
    """Handoff metrics are counted in the core's own registry and read whole by a METRICS query,
    answered by the command reader, not between steps (no per-event relay). The core runs on a thread
    here, over a real pipe."""
    import multiprocessing
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.services.engine.core_process import EngineCore
    from splitserve.services.engine.step_loop import load_engine

    ours, theirs = multiprocessing.Pipe()
    core = EngineCore(load_engine(_config(tiny_llama_dir)), theirs, _CountingHandoffs)
    serving = threading.Thread(target=core.serve, daemon=True)
    serving.start()
    assert pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") == "ready"
    call = wpb.WorkerGenerateRequest(prompt_token_ids=[1, 2, 3], prefill_address="p:1")
    for i in range(3):  # a decode worker's handoffs
        ours.send_bytes(pb.CoreCommand(add=pb.CoreAddRequest(request_id=f"r{i}", generate=call)).SerializeToString())
    query = pb.CoreQuery(call_id=7, kind=pb.CORE_QUERY_KIND_METRICS)
    ours.send_bytes(pb.CoreCommand(query=query).SerializeToString())
    while (event := pb.CoreEvent.FromString(ours.recv_bytes())).WhichOneof("event") != "reply":
        pass
    assert event.reply.call_id == 7
    families = {f.name: f for f in text_string_to_metric_families(event.reply.metrics.decode())}
    assert [s.value for s in families["splitserve_test_handoffs"].samples if s.name.endswith("_total")] == [3.0]
    ours.send_bytes(pb.CoreCommand(shutdown=True).SerializeToString())
    serving.join(30)
    assert not serving.is_alive()


class _WaitingHandoffs:
    """A core's handoffs whose every task waits until cancelled, on the core's handoff loop (CoreLoop)."""

    def __init__(self, engine, steps, send, registry) -> None:
        from splitserve.services.disagg.core_handoffs import CoreLoop

        self.loop = CoreLoop("core-handoffs", engine, torch.device("cpu"))
        self.cancelled: list[str] = []
        self.running = threading.Event()

    def start(self, request, add) -> None:
        async def wait() -> None:
            self.running.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise

        self.loop.start_task(request.request_id, wait)

    def on_step(self, step) -> None:
        pass

    def close(self) -> None:
        self.loop.close(lambda: asyncio.sleep(0))


def test_an_abort_goes_to_the_engine_which_ends_the_requests_handoff(tiny_llama_dir):
    """The serving process's abort reaches one place in the core, the engine: it ends the request
    there and the handoff task the request runs outside it (Engine.run_outside), which no longer
    holds a registration once it ended."""
    import multiprocessing

    from splitserve.services.engine.core_process import EngineCore
    from splitserve.services.engine.step_loop import load_engine

    engine = load_engine(_config(tiny_llama_dir))
    ours, theirs = multiprocessing.Pipe()
    core = EngineCore(engine, theirs, _WaitingHandoffs)
    serving = threading.Thread(target=core.serve, daemon=True)
    serving.start()
    assert pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") == "ready"
    call = wpb.WorkerGenerateRequest(prompt_token_ids=[1, 2, 3], prefill_address="p:1")
    ours.send_bytes(pb.CoreCommand(add=pb.CoreAddRequest(request_id="r", generate=call)).SerializeToString())
    assert core.handoffs.running.wait(10)
    ours.send_bytes(pb.CoreCommand(abort_request_id="r").SerializeToString())
    query = pb.CoreQuery(call_id=1, kind=pb.CORE_QUERY_KIND_DRAIN_KV_EVENTS)  # answered after the abort, in order
    ours.send_bytes(pb.CoreCommand(query=query).SerializeToString())
    while pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") != "reply":
        pass
    core.handoffs.loop.run(asyncio.sleep(0))  # the cancel, queued on the handoff loop, has run
    assert core.handoffs.cancelled == ["r"]
    assert not engine._outside  # the task's end let go of it
    ours.send_bytes(pb.CoreCommand(shutdown=True).SerializeToString())
    serving.join(30)
    assert not serving.is_alive()


@pytest.mark.parametrize("lands", [True, False])
def test_a_handed_off_requests_stages_have_one_owner_the_step_loop(tiny_llama_dir, lands):
    """A decode worker's request: the engine stamps its first token and its landing (or its recompute)
    on the step loop, before its first schedule; its step tokens carry the times across the pipe (the
    core's PipeOutputs), and the final output's stages are made from them by the serving process's
    output processor, never corrected after the fact (a CI run once saw a landing, stamped on
    another thread, come after the first decode step)."""
    from types import SimpleNamespace

    from splitserve.services.engine.core_client import _Record
    from splitserve.services.engine.core_process import PipeOutputs
    from splitserve.services.engine.output_processor import OutputProcessor

    engine = LLM(config=_config(tiny_llama_dir)).engine
    events: list[pb.CoreEvent] = []
    engine.start_output_sink(PipeOutputs(events.append, engine.finish_for_outputs))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    request = engine.make_request([1, 2, 3, 4, 5], params)
    reserved: list[int] = []
    engine.queue_reservation(request, reserved.append)
    assert reserved == [0]  # made at once: the pool has room
    record = _Record(request.request_id, params, [1, 2, 3, 4, 5], 5)
    serving = SimpleNamespace(_records={record.request_id: record})  # what EngineCoreClient._requests reads
    processor = OutputProcessor(engine.tokenizer)
    processor.add(record, 0.0)

    engine.accept_first_token(request.request_id, 9, None, (1.5, 20.0))
    if lands:
        assert engine.admit_transferred(request.request_id, 0, lambda block_ids: None)
    else:
        assert engine.recompute_locally(request.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    outs = []
    for event in events:
        msg = event.step_tokens
        requests = EngineCoreClient._requests(serving, msg)  # type: ignore[arg-type]
        step = StepTokens(requests, list(msg.token_ids), finishes_from_proto(msg), msg.time)
        outs += processor.process(step).outputs
    assert [len(e.step_tokens.handoff_times) for e in events] == [1, 1, 0, 0]  # its first token, its landing
    times = request.handoff_times
    assert times is not None and times.landed_time <= request.first_scheduled_time
    assert outs[-1].finished and outs[-1].num_output_tokens == 4
    stages = outs[-1].stages
    assert stages["prefill_queue_ms"] == 1.5 and stages["prefill_compute_ms"] == 20.0
    assert stages["kv_transfer_ms"] == pytest.approx((times.landed_time - times.first_token_time) * 1e3)
    assert stages["decode_queue_ms"] == pytest.approx((request.first_scheduled_time - times.landed_time) * 1e3)
    assert stages["first_decode_step_ms"] == pytest.approx(
        (events[1].step_tokens.time - request.first_scheduled_time) * 1e3
    )
