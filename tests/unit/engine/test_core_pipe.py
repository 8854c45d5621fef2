"""PipeWriter (services/engine/core_pipe.py), the writing end of the pipe between a worker and its
engine core, on a real pipe in this process: it never blocks its caller, keeps order, and reports a
reader that is gone (spawned cores: tests/integration/test_core_pipe_processes.py)."""

from __future__ import annotations

import multiprocessing
import threading

from splitserve.services.engine.core_pipe import PipeWriter

NUM_LONG, LONG_TOKENS = 4, 120
BOUND_S = 60.0  # only a wedged pipe takes this long


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


SOAK_REQUESTS, SOAK_CONCURRENCY = 2000, 200  # a quarter refused by the core, a quarter left early
