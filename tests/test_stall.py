"""Stall diagnostics (fsdp_native/_stall.py): a rank waiting on one of fsdp_native's
collectives longer than FSDP_NATIVE_STALL_S logs what it waits on and a report naming the
ranks behind; with FSDP_NATIVE_STALL_ACTION=raise it raises RuntimeError with that report.

One rank stops itself with SIGSTOP right before a training step (after a warm-up step); the
other runs the step and blocks in the first all-gather. With a 2 s threshold:
* log: the report is logged while the peer is still stopped (the test waits for it, then
  sends SIGCONT) and the step then completes normally on both ranks;
* raise: the step raises RuntimeError naming the stopped rank; then SIGCONT.
Both as gloo collectives and as point-to-point exchanges (FSDP_NATIVE_P2P_MIN_BYTES), and
with either rank stopped (rank 1 reports when rank 0 is the one behind). The process group is
re-created after every case.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist

import dist_utils
from dist_utils import ctx, load_impl, run_distributed, run_grid
from models import Cfg, build_fsdp, lm_loss, make_batches, make_mesh

STALL_S = 2
REPORT_WITHIN_S = 30  # generous bound on a loaded machine; the report comes after ~STALL_S + 1 s


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_stopped(pid: int) -> None:
    end = time.monotonic() + 60
    while _state(pid) != "T":
        assert time.monotonic() < end, f"rank process {pid} did not stop"
        time.sleep(0.02)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _watch_stack() -> str:
    """Where the stall watch thread is (shown with a missing report)."""
    for t in threading.enumerate():
        if t.name == "fsdp_native-stall-watch":
            frame = sys._current_frames().get(t.ident)
            return "; watch thread at:\n" + "".join(traceback.format_stack(frame)) if frame else "; watch thread not running"
    return "; no watch thread"


def _step(model, batch):
    x, y = batch
    lm_loss(model(x), y).backward()


def check(stopped: int, mode: str, p2p: bool):
    try:
        _check(stopped, mode, p2p)
    finally:
        dist_utils._reinit_pg(ctx())  # a stalled collective may still be pending on the group


def _check(stopped: int, mode: str, p2p: bool):
    from fsdp_native import _comm, _stall

    c = ctx()
    rank, impl = dist.get_rank(), load_impl()
    assert _stall.STALL_S == STALL_S, "FSDP_NATIVE_STALL_S was not passed to the workers"
    _stall.ACTION = mode
    _comm.P2P_MIN_BYTES = 1 if p2p else 4 << 20
    cfg = Cfg()
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    batches = make_batches(cfg.model_args, 2, 2)
    _step(model, batches[0])  # warm-up: lazy init, forward order
    key = f"stall_test/{c.grid_index}/pid"
    if rank == stopped:
        c.store.set(key, str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        if mode == "log":
            _step(model, batches[1])  # the step the peer is blocked in
        elif not p2p:
            model.unshard()  # the all-gather the peer gave up on, so the group drains
            model.reshard()
    else:
        pid = int(c.store.get(key))
        _wait_stopped(pid)
        cap = _Capture()
        logger = logging.getLogger("fsdp_native")
        logger.addHandler(cap)
        reported = threading.Event()
        raised = ""

        def release():
            end = time.monotonic() + REPORT_WITHIN_S
            while time.monotonic() < end and not any("stall report" in m for m in cap.messages):
                time.sleep(0.05)
            reported.set()
            os.kill(pid, signal.SIGCONT)

        try:
            if mode == "log":
                t = threading.Thread(target=release, daemon=True)
                t.start()
                _step(model, batches[1])  # blocks until the peer is continued
                t.join()
            else:
                t0 = time.monotonic()
                with pytest.raises(RuntimeError) as info:
                    _step(model, batches[1])
                raised = f"; raised after {time.monotonic() - t0:.2f} s: {info.value!r}"
                if not any("stall report" in m for m in cap.messages):
                    raised += _watch_stack()  # before the peer continues
                os.kill(pid, signal.SIGCONT)
        finally:
            os.kill(pid, signal.SIGCONT)  # never leave a rank stopped
            logger.removeHandler(cap)
        reports = [m for m in cap.messages if "stall report" in m]
        assert reports, f"no stall report within {REPORT_WITHIN_S} s; logged: {cap.messages}{raised or _watch_stack()}"
        report = reports[0]
        via = " (point-to-point)" if p2p else ""
        line = f"rank {rank}: waited "
        expected_unit = f"all_gather{via} of unit 'root'"
        assert f"fsdp_native stall report (rank {rank}, FSDP_NATIVE_STALL_S={STALL_S}):" in report, report
        assert line in report and expected_unit in report, report
        assert f"rank {stopped}: no answer within 2 s (stopped, hung, or busy outside fsdp_native's collectives)" in report, report
        assert f"behind: rank [{stopped}] (not waiting on this collective)" in report, report
        own = [m for m in cap.messages if m.startswith(f"fsdp_native: rank {rank} waited")]
        assert len(own) == 1 and expected_unit in own[0] and "step 1," in own[0], cap.messages
        if mode == "raise":
            assert str(info.value) == report, (str(info.value), report)


def _grid():
    run_grid(
        [
            dict(stopped=1, mode="log", p2p=False),
            dict(stopped=0, mode="log", p2p=False),
            dict(stopped=1, mode="raise", p2p=False),
            dict(stopped=1, mode="log", p2p=True),
            dict(stopped=1, mode="raise", p2p=True),
        ],
        check,
        name="stall",
    )


def test_stalled_rank_is_reported(monkeypatch):
    monkeypatch.setenv("FSDP_NATIVE_STALL_S", str(STALL_S))
    run_distributed(_grid, 2, timeout=200)


def check_hsdp() -> None:
    try:
        _check_hsdp()
    finally:
        dist_utils._reinit_pg(ctx())


def _check_hsdp() -> None:
    """HSDP 2x2 (shard groups [0, 1] and [2, 3], replica groups [0, 2] and [1, 3]): rank 3
    stops. Rank 1's shard group is whole, so it runs its forward and backward and then waits
    in the replica all-reduce with rank 3: it reports that all-reduce and names rank 3."""
    from fsdp_native import _stall

    c = ctx()
    rank, impl = dist.get_rank(), load_impl()
    _stall.ACTION = "log"
    cfg = Cfg(mesh="hsdp")
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    batches = make_batches(cfg.model_args, 2, 4)
    _step(model, batches[0])
    key = f"stall_test/{c.grid_index}/pid"
    if rank == 3:
        c.store.set(key, str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        _step(model, batches[1])
        return
    if rank != 1:
        _step(model, batches[1])  # blocked until rank 3 continues
        return
    pid = int(c.store.get(key))
    _wait_stopped(pid)
    cap = _Capture()
    logger = logging.getLogger("fsdp_native")
    logger.addHandler(cap)

    def release():
        end = time.monotonic() + REPORT_WITHIN_S
        while time.monotonic() < end and not any("stall report" in m for m in cap.messages):
            time.sleep(0.05)
        os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=release, daemon=True)
    try:
        t.start()
        _step(model, batches[1])
        t.join()
    finally:
        os.kill(pid, signal.SIGCONT)
        logger.removeHandler(cap)
    reports = [m for m in cap.messages if "stall report" in m]
    assert reports, f"no stall report within {REPORT_WITHIN_S} s; logged: {cap.messages}"
    report = reports[0]
    assert "rank 1: waited " in report and " on all_reduce of unit '" in report, report
    assert "rank 3: no answer within 2 s" in report and "behind: rank [3] (not waiting on this collective)" in report, report


def _grid_hsdp():
    run_grid([{}], lambda: check_hsdp(), name="stall-hsdp")


def test_stalled_replica_is_reported_in_the_hsdp_all_reduce(monkeypatch):
    monkeypatch.setenv("FSDP_NATIVE_STALL_S", str(STALL_S))
    run_distributed(_grid_hsdp, 4, timeout=240)


@pytest.mark.parametrize(
    "name,raw,expected",
    [
        ("FSDP_NATIVE_STALL_S", "-1", "FSDP_NATIVE_STALL_S must be a non-negative integer (seconds), got '-1'"),
        ("FSDP_NATIVE_STALL_S", "2.5", "FSDP_NATIVE_STALL_S must be a non-negative integer (seconds), got '2.5'"),
        ("FSDP_NATIVE_STALL_ACTION", "abort", "FSDP_NATIVE_STALL_ACTION must be one of log, raise, got 'abort'"),
    ],
)
def test_bad_stall_switch_fails_import(name, raw, expected):
    env = dict(os.environ, **{name: raw})
    r = subprocess.run([sys.executable, "-c", "import fsdp_native"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert f"ValueError: fsdp_native: environment variable {expected}" in r.stderr, r.stderr[-500:]


def test_stall_switch_values(monkeypatch):
    from fsdp_native._env import one_of

    monkeypatch.setenv("FSDP_NATIVE_STALL_ACTION", " RAISE ")
    assert one_of("FSDP_NATIVE_STALL_ACTION", "log", ("log", "raise")) == "raise"
    monkeypatch.delenv("FSDP_NATIVE_STALL_ACTION")
    assert one_of("FSDP_NATIVE_STALL_ACTION", "log", ("log", "raise")) == "log"


class _GlooLikeRecv:
    """A gloo receive whose peer never sends: ``wait(timeout)`` ends as c10d's does, after the
    timeout truncated to whole milliseconds, with gloo's error."""

    def __init__(self):
        self.timeouts = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        ms = timeout // timedelta(milliseconds=1)
        time.sleep(ms / 1000)
        raise RuntimeError(f"Timed out waiting {ms}ms for recv operation to complete")


def test_point_to_point_wait_lasts_its_whole_timeout():
    """A timed point-to-point wait must not end before its timeout: c10d truncates to whole
    milliseconds, so the wait is given the timeout rounded up (it ended up to 1 ms early, and
    the stall watch took gloo's timeout for a failure before the threshold)."""
    from fsdp_native._comm import P2PWork

    recv = _GlooLikeRecv()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^Timed out waiting \d+ms for recv"):
        P2PWork([recv]).wait(timeout=0.0505)
    assert time.perf_counter() - t0 >= 0.0505
    assert recv.timeouts[0] % timedelta(milliseconds=1) == timedelta(0), recv.timeouts


def test_point_to_point_stall_raises_the_report(monkeypatch):
    """Raise mode on a point-to-point wait whose peer never answers: the RuntimeError is the
    stall report, not gloo's timeout (in one process, no store: the report has this rank)."""
    from fsdp_native import _stall
    from fsdp_native._comm import P2PWork

    monkeypatch.setattr(_stall, "STALL_S", 1)
    monkeypatch.setattr(_stall, "ACTION", "raise")
    for _ in range(3):
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError) as info:
            _stall.wait(P2PWork([_GlooLikeRecv()]))
        assert time.perf_counter() - t0 >= 1
        assert str(info.value).startswith("fsdp_native stall report (rank "), str(info.value)
        assert "on collective (point-to-point), collective #" in str(info.value), str(info.value)
        assert "Timed out waiting" in str(info.value.__cause__)


class _LateWork:
    """A collective whose first timed wait expires just as it finishes (successfully, or with
    `error`): c10d raised "Operation timed out!" and is_completed() is then True."""

    def __init__(self, error: str | None = None):
        self.error, self.done, self.waits = error, False, 0

    def wait(self, timeout=None):
        self.waits += 1
        if not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.done


def test_raise_mode_collective_finishing_as_a_slice_expires(monkeypatch):
    """Raise mode waits on collectives in slices: one that finished right after its slice
    expired is done, not failed; one that failed raises its own error."""
    from fsdp_native import _stall

    monkeypatch.setattr(_stall, "ACTION", "raise")
    work = _LateWork()
    _stall.wait(work)
    assert work.waits == 2
    with pytest.raises(RuntimeError, match=r"^Connection closed by peer$"):
        _stall.wait(_LateWork("Connection closed by peer"))
