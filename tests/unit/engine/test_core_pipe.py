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
from splitserve.services.engine.core_pipe import PipeWriter
from splitserve.services.engine.request import FinishReason
from splitserve.services.engine.step_loop import EngineDead

NUM_LONG, LONG_TOKENS = 4, 120
BOUND_S = 60.0  # only a wedged pipe takes this long


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    )












@pytest.mark.unit
def test_a_pipe_writer_takes_every_message_while_nobody_reads_and_writes_them_in_order():
    """put never waits for the pipe (a reader thread can always hand over its refusal or its
    acknowledgement); has_room turns false at capacity and on_room fires once there is room again."""
    ours, theirs = multiprocessing.Pipe()
    rooms = threading.Event()
    writer = PipeWriter(theirs, "test-writer", on_lost=lambda e: None, capacity=8)
    writer.on_room = rooms.set
    num = 5000  # far more than the pipe's buffer holds
    put_all = threading.Event()

    def put_all_then_say_so() -> None:
        for i in range(num):
            writer.put(b"x%d" % i)
        put_all.set()

    threading.Thread(target=put_all_then_say_so, daemon=True).start()
    assert put_all.wait(BOUND_S), "a put waited for the pipe"
    assert not writer.has_room()  # the rest of them wait in the queue
    rooms.clear()  # (it had room while the pipe's buffer filled)
    assert [ours.recv_bytes() for _ in range(num)] == [b"x%d" % i for i in range(num)]
    assert rooms.wait(BOUND_S) and writer.close(BOUND_S) and writer.backlog() == 0


@pytest.mark.unit
def test_a_pipe_writer_whose_reader_is_gone_reports_it_and_releases_waiters():
    ours, theirs = multiprocessing.Pipe()
    lost = threading.Event()
    writer = PipeWriter(theirs, "test-writer", on_lost=lambda e: lost.set(), capacity=1)
    ours.close()
    writer.put(b"to nobody")
    assert lost.wait(BOUND_S)
    writer.put(b"dropped")
    writer.wait_for_room()  # returns: nobody will make room
    assert writer.has_room() and not writer.close(BOUND_S)






@pytest.mark.unit
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




