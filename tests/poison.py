"""Faults injected into an engine core process (it is spawned: a patch in its worker never reaches it).
EngineCoreClient.launch(prepare=...) runs one there after warm-up; it is pickled by name, so the
worker's PYTHONPATH must include this folder."""

from __future__ import annotations

POISON_TOKEN = 299  # a prompt starting with this token fails the core's scheduler


def poison_scheduler(engine) -> None:
    """The core's step loop raises once a prompt starting with POISON_TOKEN is scheduled."""
    scheduler = type(engine.scheduler)
    real = scheduler.schedule

    def schedule(self):
        out = real(self)
        if any(s.request.all_token_ids[0] == POISON_TOKEN for s in out.scheduled):
            raise AssertionError("injected scheduler fault")
        return out

    scheduler.schedule = schedule
