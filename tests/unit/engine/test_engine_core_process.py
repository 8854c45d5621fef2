"""The engine core in its own process (services/engine/core_process.py) behind EngineCoreClient: the same
outputs as the engine in process, refusals that leave it serving, aborts that free blocks, and a
dead core that fails every stream instead of hanging it. Real spawned processes and pipes."""

from __future__ import annotations

import dataclasses

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

    def abort(self, request_id) -> None:
        pass

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


def test_a_handoffs_stages_when_its_landing_is_stamped_after_its_first_decode_step():
    """The core stamps a landing on its handoff thread, which may run after the step loop already
    scheduled and decoded the admitted request (a CI run saw first_decode_step_ms <= 0): the stages
    still add up, the landing counted as done by the schedule."""
    from types import SimpleNamespace

    from splitserve.services.engine.core_client import _Record
    from splitserve.services.engine.outputs import StageClock

    clock = StageClock(1.0, 20.0, first_token_at=100.0)
    clock.landed_at = 100.060
    record = _Record("r", SamplingParams(), [1], 1, first_scheduled_time=100.050, first_step_time=100.055)
    stages = EngineCoreClient._handoff_stages(SimpleNamespace(_clocks={"r": clock}), record)  # type: ignore[arg-type]
    want = dict(prefill_queue_ms=1.0, prefill_compute_ms=20.0, kv_transfer_ms=50.0, decode_queue_ms=0.0)
    assert stages == pytest.approx(want | {"first_decode_step_ms": 5.0})
