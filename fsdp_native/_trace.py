"""Opt-in recorder of communication and compute spans, with bytes accounting.

When no recorder is active every call site costs one module-attribute read and a None test.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

active: "Recorder | None" = None

LANES = ("compute", "all_gather", "reduce_scatter", "all_reduce", "copy", "stall")


def now_us() -> float:
    return time.perf_counter_ns() / 1e3


@dataclass
class Span:
    name: str  # e.g. "all_gather", "forward", "stall:all_gather"
    lane: str
    unit: str
    step: int
    start_us: float
    end_us: float
    nbytes: int = 0
    args: dict = field(default_factory=dict)


class Recorder:
    """Records spans of every unit on this rank. Use through :func:`fsdp_native.record_trace`."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.step = -1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._lock = threading.Lock()  # collective-completion callbacks run on comm threads
        # Chrome timestamps are wall-clock microseconds, so traces of different ranks (and hosts
        # with synchronised clocks) line up; spans are timed with the monotonic perf counter.
        self.t0 = now_us() - time.time_ns() / 1e3

    # -- recording (runtime call sites) ------------------------------------------------
    def begin_step(self) -> None:
        self.step += 1

    def span(self, name: str, lane: str, unit: str, start: float, end: float, nbytes: int = 0, **args) -> None:
        s = Span(name, lane, unit, self.step, start, end, nbytes, args)
        with self._lock:
            self.spans.append(s)

    def collective(self, name: str, lane: str, unit: str, work, start: float, nbytes: int, **args) -> None:
        """A collective issued at `start`; its span closes when the work completes."""
        step = self.step
        if work is None:
            self.span(name, lane, unit, start, now_us(), nbytes, **args)
            return

        def done(_fut, step=step):
            s = Span(name, lane, unit, step, start, now_us(), nbytes, args)
            with self._lock:
                self.spans.append(s)

        try:
            work.get_future().add_done_callback(done)
        except (RuntimeError, AttributeError):  # a backend without futures: close at wait
            self._open = getattr(self, "_open", {})
            self._open[id(work)] = (name, lane, unit, step, start, nbytes, args)

    def waited(self, work) -> None:
        opened = getattr(self, "_open", {}).pop(id(work), None)
        if opened is not None:
            name, lane, unit, step, start, nbytes, args = opened
            with self._lock:
                self.spans.append(Span(name, lane, unit, step, start, now_us(), nbytes, args))

    # -- results ----------------------------------------------------------------------
    def bytes_summary(self) -> dict[int, dict[str, dict[str, int]]]:
        """{step: {unit: {"all_gather": bytes, "reduce_scatter": bytes, "all_reduce": bytes}}}."""
        out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
        for s in self.spans:
            if s.lane in ("all_gather", "reduce_scatter", "all_reduce") and s.nbytes:
                for unit, nbytes in s.args.get("per_unit", {s.unit: s.nbytes}).items():
                    out[s.step][unit][s.lane] += nbytes
        return {k: {u: dict(v) for u, v in d.items()} for k, d in out.items()}

    def stall_us(self, step: int | None = None) -> float:
        """Time compute waited on communication (total, or in one step)."""
        return sum(s.end_us - s.start_us for s in self.spans if s.lane == "stall" and (step is None or s.step == step))

    def chrome_trace(self) -> dict:
        tids = {lane: i for i, lane in enumerate(LANES)}
        events = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
        ]
        for lane, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}})
        for s in sorted(self.spans, key=lambda s: s.start_us):
            args = {"unit": s.unit, "step": s.step, **{k: v for k, v in s.args.items() if k != "per_unit"}}
            if s.nbytes:
                args["bytes"] = s.nbytes
            events.append(
                {
                    "name": f"{s.name} [{s.unit or 'root'}]",
                    "cat": s.lane,
                    "ph": "X",
                    "ts": s.start_us - self.t0,
                    "dur": max(s.end_us - s.start_us, 0.001),
                    "pid": self.rank,
                    "tid": tids[s.lane],
                    "args": args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str) -> str:
        """Writes this rank's Chrome trace JSON (opens in Perfetto / chrome://tracing)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


class record_trace:
    """Context manager that records fsdp_native's communication and compute spans on this rank.

    Example::

        with fsdp_native.record_trace() as rec:
            for batch in loader:
                loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
        rec.export_chrome_trace(f"trace/rank{rank}.json")
        print(rec.bytes_summary())
    """

    def __init__(self) -> None:
        self.recorder = Recorder()

    def __enter__(self) -> Recorder:
        global active
        if active is not None:
            raise RuntimeError("record_trace: a recorder is already active on this process")
        active = self.recorder
        return self.recorder

    def __exit__(self, *exc) -> None:
        global active
        active = None
