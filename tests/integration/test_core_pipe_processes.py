"""The pipe between a worker's serving process and its engine core (services/engine/core_client.py,
services/engine/core_process.py): a serving process that reads the core's events slowly, while adds the core
refuses keep coming, never wedges either side; a core that makes no progress while work is queued
is given up on (its streams fail, the worker stops serving and exits). Real spawned cores and pipes.

Each direction of the pipe is a kernel buffer of a few hundred small messages. The serving side's
event reader is paused here with a gate (standing in for a serving process that falls behind the
core) while thousands of adds go out: far more than both directions hold together."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.request import FinishReason
from splitserve.services.engine.step_loop import EngineDead

NUM_REFUSED = 3000  # refused adds: their refusals alone are several times what the pipe holds
NUM_LONG, LONG_TOKENS = 4, 120
BOUND_S = 60.0  # only a wedged pipe takes this long


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    )


class _HeldEvents:
    """The client's end of the pipe, whose event reader, once `hold` is set, keeps the next step's
    tokens it reads until `release`: a serving process that fell behind the core in the middle of
    a step (it acknowledges that step as soon as it goes on). Everything else goes straight through."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self.hold, self.holding, self.release = threading.Event(), threading.Event(), threading.Event()

    def recv_bytes(self, *args):
        data = self._conn.recv_bytes(*args)
        if self.hold.is_set() and not self.release.is_set() and _is_step(data):
            self.holding.set()
            self.release.wait()
        return data

    def __getattr__(self, name):
        return getattr(self._conn, name)


def _is_step(data: bytes) -> bool:
    return pb.CoreEvent.FromString(data).WhichOneof("event") == "step_tokens"


async def _outputs(stream) -> list:
    return [out async for out in stream]


async def _refusal(stream) -> BaseException | None:
    try:
        async for _ in stream:
            pass
    except ValueError as e:
        return e
    return None


def test_a_slow_event_reader_and_refused_adds_never_wedge_the_pipe(tiny_llama_dir):
    """The reviewer's deadlock (issue 43, item 2), made deterministic: with the event reader paused,
    the core's events fill core->serving; the core refuses adds as they come, and must keep reading
    commands; the serving side's adds must never block its event loop. Once the reader goes on,
    everything drains: every long request runs to its length, every refused one ends with
    ValueError, and the core serves on."""
    client = EngineCoreClient.launch(_config(tiny_llama_dir))
    events = client._conn = _HeldEvents(client._conn)  # before start(): the event reader reads through it
    flooded, finished = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    async def main() -> None:
        client.start()
        params = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
        streams = [client.generate([i + 1, 2, 3], params) for i in range(NUM_LONG)]
        firsts = [await anext(stream) for stream in streams]  # running: steps keep coming
        events.hold.set()
        assert await asyncio.to_thread(events.holding.wait, BOUND_S), "no step came"
        long = [asyncio.ensure_future(_outputs(stream)) for stream in streams]
        bad = SamplingParams()
        refused = [asyncio.ensure_future(_refusal(client.generate([1, 99999], bad))) for _ in range(NUM_REFUSED)]
        await asyncio.sleep(0)  # after every stream's first step (its add handed over): the loop is free
        flooded.set()
        results["long"] = [[first, *outs] for first, outs in zip(firsts, await asyncio.gather(*long))]
        results["refused"] = await asyncio.gather(*refused)
        results["after"] = await _outputs(client.generate([5, 6], SamplingParams(temperature=0, max_tokens=3)))
        await client.shutdown()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by the test's thread
            results["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        loop_free = flooded.wait(BOUND_S)  # false: the event loop blocked writing an add
        events.release.set()
        drained = finished.wait(BOUND_S)
    finally:
        events.release.set()
        if not finished.is_set():
            client._process.kill()  # unwedge the threads left behind
    assert drained, f"the pipe never drained once the event reader went on (event loop free: {loop_free})"
    assert loop_free, "the event loop blocked on a pipe write while the event reader was held"
    assert "error" not in results, results.get("error")
    for outs in results["long"]:
        assert sum(len(o.new_token_ids) for o in outs) == LONG_TOKENS
        assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == LONG_TOKENS
    assert all(isinstance(e, ValueError) for e in results["refused"]), "a refused add's stream did not end"
    assert results["after"][-1].num_output_tokens == 3
    assert client.exitcode == 0 and not client.died.is_set()


# -- the watchdog ------------------------------------------------------------------------------------
STALL_S = 2.0  # the watchdog's bound in these tests


def test_a_core_that_makes_no_progress_with_work_queued_is_given_up_on(tiny_llama_dir):
    """A hung core (stopped here with SIGSTOP: its pipe stays open, it never sends again) would
    leave every stream waiting for ever and the worker serving. The watchdog kills it: the streams
    end with EngineDead naming the stall, and died is set (the worker leaves and exits)."""
    client = EngineCoreClient.launch(_config(tiny_llama_dir), stall_timeout_s=STALL_S)

    async def main() -> None:
        client.start()
        params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
        stream = client.generate([1, 2, 3], params)
        await anext(stream)
        os.kill(client.pid, signal.SIGSTOP)
        with pytest.raises(EngineDead, match="made no progress"):
            await asyncio.wait_for(_outputs(stream), BOUND_S)
        await asyncio.wait_for(client.died.wait(), BOUND_S)
        with pytest.raises(EngineDead):
            await _outputs(client.generate([1], params))

    try:
        asyncio.run(main())
    finally:
        client._process.kill()
    assert client.exitcode == -signal.SIGKILL


def test_a_worker_whose_core_makes_no_progress_stops_serving_and_exits(tiny_llama_dir, monkeypatch):
    """The worker's side of the watchdog: health goes NOT_SERVING, the stream ends UNAVAILABLE, and
    serve_worker raises EngineDied (the CLI exits 3: restarted by `up` or the container's policy)."""
    import grpc
    from grpc_health.v1 import health, health_pb2

    from splitserve.common.serving import free_port
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.services.worker import server

    statuses: list[int] = []
    real_set = health.aio.HealthServicer._set  # what set and enter_graceful_shutdown both call

    async def set_status(self, service, status):
        statuses.append(status)
        await real_set(self, service, status)

    monkeypatch.setattr(health.aio.HealthServicer, "_set", set_status)
    config = server.WorkerConfig(engine=_config(tiny_llama_dir), port=free_port(), engine_stall_timeout_s=STALL_S)

    async def run() -> None:
        task = asyncio.create_task(server.serve_worker(config))
        while health_pb2.HealthCheckResponse.SERVING not in statuses:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        (core,) = [p for p in multiprocessing.active_children() if p.name == "splitserve-engine-core"]
        request = worker_pb2.WorkerGenerateRequest(
            prompt_token_ids=[1, 2, 3], params=worker_pb2.EngineSamplingParams(max_tokens=240, ignore_eos=True)
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=BOUND_S)
            await anext(aiter(call))
            os.kill(core.pid, signal.SIGSTOP)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no progress" in e.value.details()
        with pytest.raises(server.EngineDied):
            await asyncio.wait_for(task, BOUND_S)

    asyncio.run(run())
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING


# -- the soak -----------------------------------------------------------------------------------------
class _SlowReads:
    """The client's end of the pipe, whose event reader takes delay_s more per event: a serving
    process busier than its core (the core then waits for room before its steps)."""

    def __init__(self, conn, delay_s: float) -> None:
        self._conn, self._delay_s = conn, delay_s

    def recv_bytes(self, *args):
        data = self._conn.recv_bytes(*args)
        time.sleep(self._delay_s)  # the slow serving process this stands in for
        return data

    def __getattr__(self, name):
        return getattr(self._conn, name)


SOAK_REQUESTS, SOAK_CONCURRENCY = 2000, 200  # a quarter refused by the core, a quarter left early
SOAK_READ_DELAY_S = 0.02


def test_soak_a_worker_whose_serving_side_reads_slowly(tiny_llama_dir, monkeypatch):
    """A real worker and core, the event reader slowed, many concurrent requests (valid, refused by
    the core, abandoned): every request ends as it should, health answers SERVING throughout (the
    event loop never blocks), and the core's pool is whole afterwards. Prints what it measured."""
    import random

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.common.serving import free_port
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.services.worker import server

    clients: list[EngineCoreClient] = []
    real_launch = EngineCoreClient.launch.__func__

    def launch(cls, *args, **kwargs):
        client = real_launch(cls, *args, **kwargs)
        client._conn = _SlowReads(client._conn, SOAK_READ_DELAY_S)  # before start(): the reader reads through it
        clients.append(client)
        return client

    monkeypatch.setattr(EngineCoreClient, "launch", classmethod(launch))
    config = server.WorkerConfig(engine=_config(tiny_llama_dir), port=free_port())
    rng = random.Random(43)
    kinds = [rng.choice(["ok", "ok", "refused", "left"]) for _ in range(SOAK_REQUESTS)]

    def request(i: int, kind: str) -> worker_pb2.WorkerGenerateRequest:
        prompt = [1 + i % 200, 2, 3] if kind != "refused" else rng.choice([[1, 99999], [1] * 300])
        params = worker_pb2.EngineSamplingParams(max_tokens=rng.randint(1, 100), ignore_eos=True)
        return worker_pb2.WorkerGenerateRequest(prompt_token_ids=prompt, params=params)

    async def one(stub, i: int, kind: str) -> str:
        call = stub.Generate(request(i, kind), timeout=BOUND_S * 3)
        try:
            n = 0
            async for _ in call:
                n += 1
                if kind == "left":
                    call.cancel()
                    return "left"
            return "ok" if n else "empty"
        except grpc.aio.AioRpcError as e:
            return "refused" if e.code() == grpc.StatusCode.INVALID_ARGUMENT else f"error {e.code().name}"

    async def run() -> dict:
        task = asyncio.create_task(server.serve_worker(config))
        address = f"127.0.0.1:{config.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            while True:  # until it serves (the core loads first)
                assert not task.done(), task.exception()
                try:
                    await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1, wait_for_ready=True)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            stub = worker_pb2_grpc.WorkerStub(channel)
            loop = asyncio.get_running_loop()
            started = loop.time()
            slots = asyncio.Semaphore(SOAK_CONCURRENCY)  # arrivals keep coming while the pipe is full

            async def in_turn(i: int, kind: str) -> str:
                async with slots:
                    return await one(stub, i, kind)

            calls = asyncio.gather(*(in_turn(i, kind) for i, kind in enumerate(kinds)))
            checks = []
            while not calls.done():  # health answers throughout: the event loop never blocks
                before = loop.time()
                reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                checks.append((reply.status, loop.time() - before))
                await asyncio.wait({calls}, timeout=0.2)  # the next check, or the end
            results = await calls
            seconds = loop.time() - started
            load = await _idle_load(clients[0])
            await worker_pb2_grpc.WorkerStub(channel).Drain(worker_pb2.DrainRequest(), timeout=10)
        await asyncio.wait_for(task, BOUND_S)
        return dict(results=results, checks=checks, seconds=seconds, load=load)

    got = asyncio.run(run())
    results, checks, load = got["results"], got["checks"], got["load"]
    assert results == kinds, [(k, r) for k, r in zip(kinds, results) if k != r][:5]
    assert checks and all(status == health_pb2.HealthCheckResponse.SERVING for status, _ in checks)
    assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks
    assert not clients[0].died.is_set() and clients[0].exitcode == 0
    print(
        f"\nsoak: {len(kinds)} requests, {SOAK_CONCURRENCY} at a time ({kinds.count('ok')} ok, "
        f"{kinds.count('refused')} refused, "
        f"{kinds.count('left')} left) in {got['seconds']:.1f} s with the event reader {SOAK_READ_DELAY_S * 1e3:.0f} ms "
        f"slower per event; {len(checks)} health checks, slowest {max(s for _, s in checks) * 1e3:.0f} ms"
    )


async def _idle_load(client: EngineCoreClient):
    """The core's load once nothing runs and every block is back (it reports within 100 ms)."""
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while True:
        load = client.load()
        idle = load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks
        if idle or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.05)


def test_an_idle_core_still_says_it_is_alive(tiny_llama_dir):
    """With nothing to do, a core's load does not change; it still goes out every KEEPALIVE_S, so
    that a quiet core with work the serving process waits on (a decode worker's requests awaiting
    their KV) is never taken for a hung one. The core runs on a thread here, over a real pipe."""
    from splitserve.services.engine.core_process import EngineCore
    from splitserve.services.engine.step_loop import load_engine

    ours, theirs = multiprocessing.Pipe()
    core = EngineCore(load_engine(_config(tiny_llama_dir)), theirs)
    serving = threading.Thread(target=core.serve, daemon=True)
    serving.start()
    kinds = []
    while kinds.count("load") < 3:
        assert ours.poll(BOUND_S), f"an idle core went silent after {kinds}"
        kinds.append(pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event"))
    ours.send_bytes(pb.CoreCommand(shutdown=True).SerializeToString())
    serving.join(BOUND_S)
    assert not serving.is_alive()


SOAK_REQUESTS, SOAK_CONCURRENCY = 2000, 200  # a quarter refused by the core, a quarter left early
