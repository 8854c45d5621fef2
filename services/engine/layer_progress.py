"""How far a step's forward has got, layer by layer, as another thread sees it: what lets a prefill
worker send a prompt's KV one layer at a time while the later layers still compute (layer-by-layer
streaming, services/disagg/prefill.py).

The step thread marks each layer once its KV is written into the cache (ModelRunner.forward); a
sender's thread waits for the layers it is about to read. On CUDA, a layer counts as written once
its kernels are queued, and the waiter's stream then waits on an event recorded right after them,
so nothing blocks the host longer than the queueing. A forward that fails wakes every waiter with
StepFailed.
"""

from __future__ import annotations

import threading

import torch


class StepFailed(RuntimeError):
    """The forward ended before writing the layers a waiter wanted (the transfer reading them fails)."""


class LayerProgress:
    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self._device = device
        self._cuda = device.type == "cuda"
        self._events: list[torch.cuda.Event] = []  # CUDA: one per written layer, in order
        self._num_done = 0
        self._error: str | None = None
        self._changed = threading.Condition()

    def layer_done(self, index: int) -> None:
        """Step thread: layer index's KV is in the cache (layers finish in order)."""
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        with self._changed:
            if event is not None:
                self._events.append(event)
            self._num_done = index + 1
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """Step thread: the forward raised; layers not written yet never will be."""
        with self._changed:
            self._error = f"{type(error).__name__}: {error}"
            self._changed.notify_all()

    @property
    def num_done(self) -> int:
        return self._num_done

    def wait(self, num_layers: int) -> None:
        """Block until the first num_layers layers' KV is written (on CUDA: the current stream waits
        for it too); StepFailed if the forward failed first."""
        with self._changed:
            self._changed.wait_for(lambda: self._num_done >= num_layers or self._error is not None)
            if self._num_done < num_layers:
                raise StepFailed(f"the prefill step failed before layer {num_layers - 1} was written ({self._error})")
            event = self._events[num_layers - 1] if self._cuda and num_layers else None
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def wait_rows(self, rows: slice) -> None:
        """wait() for the layers behind rows [start, stop) of a KV piece's [num_layers * 2, -1] view."""
        self.wait(-(-rows.stop // 2))
