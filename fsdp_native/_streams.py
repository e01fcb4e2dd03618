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
import os
import time

import torch

from fsdp_native import _stall, ops
from fsdp_native._env import non_negative_int


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

    def wait_work(self, work) -> None:
        """Waits for a collective. On CUDA ``work.wait()`` only makes the current stream wait.
        On CPU it blocks the thread until a gloo thread wakes it; for the short collectives
        of small units that wake-up is a large part of the latency, so the thread first polls
        the work for up to SPIN_S, yielding its core to whatever else is runnable between polls.
        A CPU wait past FSDP_NATIVE_STALL_S is reported (``_stall``). The fake process group's
        works never say they are complete, so they are waited on at once, without the poll."""
        if self.cuda:
            work.wait()
            return
        if SPIN_S > 0 and getattr(work, "pollable", True) and not isinstance(work, _NEVER_COMPLETE) \
                and not work.is_completed():
            deadline = time.perf_counter() + SPIN_S
            while not work.is_completed() and time.perf_counter() < deadline:
                os.sched_yield()
        _stall.wait(work)


# How long a CPU rank polls a collective before blocking on it (FSDP_NATIVE_SPIN_US, 0: never).
SPIN_S = non_negative_int("FSDP_NATIVE_SPIN_US", 5000, "microseconds") / 1e6

# Works whose is_completed() stays False though wait() returns at once (torch's fake process
# group, testing and memory replays): polling them would spin the whole SPIN_S every time.
_NEVER_COMPLETE = tuple(t for t in (getattr(torch._C._distributed_c10d, "FakeWork", None),) if t is not None)

_CPU = Streams(torch.device("cpu"))


def streams_for(device: torch.device) -> Streams:
    return _CPU if device.type != "cuda" else Streams(device)
