"""Compute / all-gather / reduce-scatter streams and the event waits between them.

On CUDA, collectives and their copies run on their own streams. A buffer that one stream
produces and another consumes is handed over with ``ops.stream_wait`` (an event recorded on
the producer, waited on by the consumer, no host sync), and a buffer allocated on one stream
but used on another is released only after the allocating stream has waited for the user:
no ``recordStream``. On CPU the streams are ``None``, the host runs everything in program
order, and the same calls are no-ops, so the runtime has a single code path.
"""
from __future__ import annotations

import contextlib

import torch

from fsdp_native import ops


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.all_gather = torch.cuda.Stream(device, priority=-1)
            self.reduce_scatter = torch.cuda.Stream(device, priority=-1)
        else:
            self.compute = self.all_gather = self.reduce_scatter = None

    def use(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def wait(self, anchor: torch.Tensor, waiter, signaler) -> None:
        """`waiter` waits for the work queued so far on `signaler`."""
        if self.cuda:
            ops.stream_wait(anchor, waiter, signaler)


_CPU = Streams(torch.device("cpu"))


def streams_for(device: torch.device) -> Streams:
    return _CPU if device.type != "cuda" else Streams(device)
