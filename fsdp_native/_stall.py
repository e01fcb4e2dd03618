"""Stall diagnostics: a rank that waits on one of fsdp_native's collectives for longer than
``FSDP_NATIVE_STALL_S`` seconds (default 300, 0 turns it off) says what it waits on, and
which ranks are behind, instead of blocking silently until the process group's timeout.

* Every CPU wait on a collective goes through :func:`wait` (``Streams.wait_work``). It counts
  the wait and notes when it began: a counter, a clock read and one tuple. Every rank waits on
  fsdp_native's collectives in the same order, so the count is a position comparable across
  ranks. Nothing else is recorded per wait.
* A daemon thread, started at the first wait, looks at the wait in progress every ``TICK_S``.
  Past ``ANSWER_AFTER_S`` it answers other ranks' report requests; past ``STALL_S`` it
  describes the wait (step, unit, collective, bytes, read from the waiting thread's frames, so
  only now), logs it once, publishes it to the c10d store of the default process group (the
  store, not a collective: the process group is what is stuck), asks the other ranks of the
  collective's group for theirs and, after up to ``GRACE_S``, writes the report: every rank's
  position, and the ranks behind. A stopped or hung rank cannot answer; its silence names it.
  The lowest rank of the group that answered logs the report (rank 0 for groups with it).
* Why a thread and not timed waits in the waiting thread: a timed wait on a gloo
  point-to-point work (fsdp_native's large all-gathers and reduce-scatters) that expires
  closes the connection to the peer ("Application timeout caused pair closure"), so while the
  wait may still succeed it has to be a plain blocking wait.
* ``FSDP_NATIVE_STALL_ACTION=raise``: the waiting thread waits on collectives in slices of
  ``SLICE_S`` (an expired slice leaves a gloo collective intact) and on point-to-point works up
  to the threshold, then raises ``RuntimeError`` with the report instead of waiting out the
  process group's timeout. The process group is not usable afterwards (a collective is still
  pending on it; a point-to-point connection was closed).

``step`` in the reports counts forward passes of the root module since its first one
(micro-batches count one each). On CUDA waits only order streams; nothing here applies.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp_native._env import non_negative_int, one_of

# Seconds a wait may last before it is reported (FSDP_NATIVE_STALL_S; 0: never).
STALL_S = non_negative_int("FSDP_NATIVE_STALL_S", 300, "seconds")
# "log": report and keep waiting; "raise": report and raise RuntimeError.
ACTION = one_of("FSDP_NATIVE_STALL_ACTION", "log", ("log", "raise"))

TICK_S = 0.25  # the watch thread's period
ANSWER_AFTER_S = 1.0  # a rank waiting this long answers report requests
GRACE_S = 2.0  # how long a reporting rank waits for the others' answers
SLICE_S = 0.25  # raise mode: slices of a wait on a collective
REPORT_WAIT_S = 60.0  # raise mode: the longest a given-up point-to-point wait waits for its report

_KEY = "fsdp_native/stall"
log = logging.getLogger("fsdp_native")


class _State:
    """Shared by the waiting (main) thread and the watch thread; plain attribute writes only."""

    def __init__(self) -> None:
        self.seq = 0  # waits entered so far
        self.current: tuple | None = None  # (seq, start, work) of the wait in progress
        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root module -> forwards
        self.thread: threading.Thread | None = None
        self.main = 0  # ident of the waiting thread
        self.rank = 0
        self.store = None  # the default process group's store when last looked up
        self.answered = 0  # report requests answered so far (in that store)
        self.described: tuple[int, dict] | None = None
        self.reported = 0  # seq of the last wait reported
        self.report: tuple[int, str] | None = None  # (seq, report) of the last wait reported


_S = _State()


def wait(work) -> None:
    """Waits for `work` (a c10d work or a point-to-point ``P2PWork``) on CPU, watched."""
    s = _S
    s.seq += 1
    if STALL_S == 0:
        work.wait()
        return
    if s.thread is None:
        _start()
    s.current = (s.seq, time.perf_counter(), work)
    try:
        if ACTION == "raise":
            _wait_or_raise(work)
        else:
            work.wait()
    finally:
        s.current = None


def attach(root) -> None:
    """Counts the forward passes of `root` (the step in reports) from the current one, its
    first. The hook runs before fully_shard's, whose all-gather may be the wait reported."""
    if STALL_S and root not in _S.steps:
        _S.steps[root] = 0
        root.register_forward_pre_hook(torch.compiler.disable(_count_step, recursive=True), prepend=True)


def _count_step(module, args) -> None:
    _S.steps[module] += 1


# --------------------------------------------------------------------------------------------
# raise mode


def _wait_or_raise(work) -> None:
    s = _S
    seq, start, _ = s.current
    if not getattr(work, "pollable", True):  # point-to-point: one wait, up to the threshold
        deadline = start + STALL_S
        try:
            work.wait(timeout=max(deadline - time.perf_counter(), 0.001))
            return
        except RuntimeError as e:
            if time.perf_counter() < deadline:
                raise  # a failure, not the threshold
            raise RuntimeError(_await_report(seq)) from e
    slice_ = timedelta(seconds=SLICE_S)
    while True:
        try:
            work.wait(slice_)
            return
        except RuntimeError:
            if work.is_completed():  # failed, or finished right after the slice expired
                work.wait()  # raises the collective's own error, if any
                return
        r = s.report
        if r is not None and r[0] == seq:
            raise RuntimeError(r[1])


def _await_report(seq: int) -> str:
    """The watch thread's report of wait `seq`: it comes a tick + ``GRACE_S`` after the
    threshold on a machine with CPU to spare. Waited for up to ``REPORT_WAIT_S``, not a bound
    near that, so a starved or descheduled process still raises the report; only a watch
    thread that cannot run at all leaves the short message."""
    end = time.perf_counter() + REPORT_WAIT_S
    while time.perf_counter() < end:
        r = _S.report
        if r is not None and r[0] == seq:
            return r[1]
        time.sleep(0.02)
    return f"fsdp_native: rank {_S.rank} waited more than FSDP_NATIVE_STALL_S={STALL_S} s on collective #{seq}"


# --------------------------------------------------------------------------------------------
# the watch thread


def _start() -> None:
    s = _S
    s.main = threading.get_ident()
    s.thread = threading.Thread(target=_watch, name="fsdp_native-stall-watch", daemon=True)
    s.thread.start()


def _refresh() -> None:
    """This rank and the default process group's store (re-read: the group may have been
    re-created since the last stall)."""
    s = _S
    store = None
    if dist.is_available() and dist.is_initialized():
        s.rank = dist.get_rank()
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:  # no store: each rank still reports its own wait
            store = None
    if store is not s.store:
        s.store, s.answered = store, 0


def _watch() -> None:
    s = _S
    while True:
        time.sleep(TICK_S)
        cur = s.current
        if cur is None:
            continue
        seq, start, work = cur
        waited = time.perf_counter() - start
        try:
            if waited < ANSWER_AFTER_S:
                continue
            if s.described is None or s.described[0] != seq:
                _refresh()
            if s.store is not None:
                _answer(seq, waited, work)
            if waited >= STALL_S and s.reported != seq:
                s.reported = seq
                _on_stall(seq, waited, work)
        except Exception:  # the watch must outlive any failure of its own
            log.exception("fsdp_native: the stall watch failed")


def _on_stall(seq: int, waited: float, work) -> None:
    s = _S
    me = _describe(seq, waited, work)
    log.warning("fsdp_native: rank %d %s", s.rank, _fmt(me))
    report, lowest = _gather(me, seq, waited, work)
    s.report = (seq, report)
    if lowest:  # one log per group: its lowest answering rank (rank 0 for the world's groups)
        log.warning("%s", report)


def _answer(seq: int, waited: float, work) -> None:
    """Publishes this rank's wait under every report request not answered yet."""
    s = _S
    n = s.store.add(f"{_KEY}/requests", 0)
    if n <= s.answered:
        return
    record = json.dumps(_describe(seq, waited, work))
    for req in range(s.answered + 1, n + 1):
        s.store.set(f"{_KEY}/{req}/{s.rank}", record)
    s.answered = n


def _gather(me: dict, seq: int, waited: float, work) -> tuple[str, bool]:
    """The report of every rank of the waited collective's group; whether this rank is the
    lowest one that answered (the one that logs it: rank 0 unless it is silent or outside the
    group, as for an HSDP replica group)."""
    s = _S
    ranks = me.get("group_ranks") or [s.rank]
    got = {s.rank: me}
    if s.store is not None:
        req = s.store.add(f"{_KEY}/requests", 1)
        _answer(seq, waited, work)
        end = time.perf_counter() + GRACE_S
        while True:
            for r in ranks:
                key = f"{_KEY}/{req}/{r}"
                if r not in got and s.store.check([key]):
                    got[r] = json.loads(s.store.get(key))
            if len(got) >= len(ranks) or time.perf_counter() > end:
                break
            time.sleep(0.05)
    lines = [f"fsdp_native stall report (rank {s.rank}, FSDP_NATIVE_STALL_S={STALL_S}):"]
    for r in ranks:
        if r in got:
            lines.append(f"  rank {r}: {_fmt(got[r])}")
        else:
            lines.append(
                f"  rank {r}: no answer within {GRACE_S:.0f} s (stopped, hung, or busy outside fsdp_native's collectives)"
            )
    silent = [r for r in ranks if r not in got]
    if silent:
        lines.append(f"  behind: rank{'s' if len(silent) > 1 else ''} {silent} (not waiting on this collective)")
    else:
        pos = {r: (got[r].get("step") or 0, got[r]["seq"]) for r in ranks}
        low = min(pos.values())
        behind = [r for r in ranks if pos[r] == low]
        if len(behind) < len(ranks):
            lines.append(f"  behind: rank{'s' if len(behind) > 1 else ''} {behind} (the ranks wait on different collectives)")
        else:
            lines.append("  every rank waits on this collective; none is behind (the transport may be stuck)")
    return "\n".join(lines), s.rank == min(got)


# --------------------------------------------------------------------------------------------
# what a wait is


def _describe(seq: int, waited: float, work) -> dict:
    """Step, unit, collective, bytes and group of the wait `seq`, from the waiting thread's
    frames (computed once per wait; `waited` refreshed)."""
    s = _S
    if s.described is not None and s.described[0] == seq:
        d = dict(s.described[1], waited=round(waited, 1))
        return d
    d = {"rank": s.rank, "seq": seq, "step": None, "waited": round(waited, 1), "kind": "collective"}
    if type(work).__name__ == "P2PWork":
        d["via"] = "point-to-point"
    frame = sys._current_frames().get(s.main)
    group = None
    while frame is not None:
        name, loc = frame.f_code.co_name, frame.f_locals
        owner = loc.get("self")
        if name == "wait_all_gather" and hasattr(owner, "pending_ag"):
            d["kind"], d["unit"], d["step"] = "all_gather", owner.fqn or "root", _step_of(owner)
            out = loc.get("out")
            if out is not None:
                d["bytes"] = out.numel() * out.element_size()
            pf = getattr(owner, "post_forward", None)
            group = pf[0] if pf is not None and getattr(owner, "_pf_shard_in_flight", None) is not None else owner.info.shard_group
            break
        if name == "take_reduced" and getattr(getattr(owner, "info", None), "replicate_group", None) is not None:
            d["kind"], d["unit"], d["step"] = "all_reduce", owner.fqn or "root", _step_of(owner)
            out = loc.get("out")
            if out is not None:
                d["bytes"] = out.numel() * out.element_size()
            group = owner.info.replicate_group
            break
        if name == "release_pending" and hasattr(owner, "pending_ag"):
            d["kind"], d["unit"], d["step"] = "all_gather", owner.fqn or "root", _step_of(owner)
            group = owner.info.shard_group
            break
        if name == "finish" and hasattr(owner, "entries") and owner.entries:
            units = [e.unit for e in owner.entries]
            d["kind"], d["unit"], d["step"] = "reduce_scatter", "+".join(u.fqn or "root" for u in units), _step_of(units[0])
            if getattr(owner, "rs_in", None) is not None:
                d["bytes"] = owner.rs_in.numel() * owner.rs_in.element_size()
            group = units[0].info.shard_group
            break
        frame = frame.f_back
    del frame
    try:
        d["group_ranks"] = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except Exception:
        d["group_ranks"] = [s.rank]
    s.described = (seq, d)
    return d


def _step_of(unit) -> int | None:
    ctx = getattr(unit, "ctx", None)
    return _S.steps.get(ctx.root) if ctx is not None else None


def _fmt(d: dict) -> str:
    what = f"{d['kind']}"
    if d.get("via"):
        what += f" ({d['via']})"
    if d.get("unit") is not None:
        what += f" of unit '{d['unit']}'"
    if d.get("bytes") is not None:
        what += f", {_fmt_bytes(d['bytes'])}"
    step = f", step {d['step']}" if d.get("step") is not None else ""
    return f"waited {d['waited']:.1f} s on {what}{step}, collective #{d['seq']}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
