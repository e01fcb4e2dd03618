"""fsdp_native.checkpoint: crash-safe DCP checkpoints (a new directory per save, committed by
rank 0 after every rank finished, the last `keep` kept, incomplete ones skipped with a warning).

* round trip: model + AdamW saved, loaded into a model built from other weights: parameters
  and optimizer states bit-exact, and training on from there gives the uninterrupted run's
  losses as exact floats (fp32);
* keep=N prunes the oldest complete checkpoints and the directories of unfinished saves;
  saving a step again replaces it;
* incomplete directories (an unfinished save, a step directory with no commit file) are skipped
  by load_latest with a warning naming each;
* errors name the argument;
* kill test: rank 1 is SIGKILLed while its data file of a save is half written (a test-only
  stream that writes half the bytes, fsyncs, signals and waits); the previous checkpoint
  loads and resuming from it reproduces the uninterrupted run bit for bit. This test starts
  its own processes for the save that crashes (the harness expects every rank to live).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dist_utils import ctx, full, load_impl, run_distributed, run_grid
from models import Cfg, build_fsdp, make_mesh, make_optim, train_fsdp


def _ckpt():
    import fsdp_native.checkpoint as ckpt

    return ckpt


class TrainState(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


CFG = Cfg(model="odd", steps=5)
SAVE_AT = 3


def _shared_dir(name: str) -> str:
    path = os.path.join(ctx().tmpdir, name)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _opt_states(opt) -> dict:
    return {
        (i, k): full(v) if isinstance(v, torch.Tensor) else v
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
    }


def _assert_bitwise(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what} differs"


def _warned(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(x.message) for x in w if issubclass(x.category, _ckpt().IncompleteCheckpointWarning)]


# --------------------------------------------------------------------------------------------


def check_round_trip():
    ckpt, impl = _ckpt(), load_impl()
    root = _shared_dir("round_trip")
    mesh = make_mesh(CFG)
    model = build_fsdp(impl, CFG, mesh)
    opt = make_optim(CFG, model.parameters())
    train_fsdp(impl, model, CFG, opt=opt, stop=SAVE_AT)
    path = ckpt.save({"train": TrainState(model, opt)}, root, SAVE_AT, keep=2)
    assert path == os.path.join(root, "step-00000003") and os.path.isfile(os.path.join(path, ckpt.COMMIT_FILE))
    saved_params = {n: full(p) for n, p in model.named_parameters()}
    saved_opt = _opt_states(opt)
    ref = train_fsdp(impl, model, CFG, opt=opt, start=SAVE_AT)

    other = build_fsdp(impl, CFG, mesh, seed=99)
    opt2 = make_optim(CFG, other.parameters())
    other(torch.zeros(1, 4, dtype=torch.long)).sum().backward()  # optimizer states to overwrite
    opt2.step()
    opt2.zero_grad()
    (step, msgs) = _warned(lambda: ckpt.load_latest({"train": TrainState(other, opt2)}, root))
    assert step == SAVE_AT and msgs == [], (step, msgs)
    for n, p in other.named_parameters():
        _assert_bitwise(f"parameter {n} after load_latest", full(p), saved_params[n])
    loaded_opt = _opt_states(opt2)
    assert loaded_opt.keys() == saved_opt.keys()
    for k, v in saved_opt.items():
        if isinstance(v, torch.Tensor):
            _assert_bitwise(f"optimizer state {k} after load_latest", loaded_opt[k], v)
        else:
            assert loaded_opt[k] == v, k
    rest = train_fsdp(impl, other, CFG, opt=opt2, start=SAVE_AT)
    assert rest["losses"] == ref["losses"], f"resumed losses {rest['losses']} != uninterrupted {ref['losses']}"
    for n, p in ref["params"].items():
        _assert_bitwise(f"final {n} after resume", rest["params"][n], p)


def check_keep():
    ckpt = _ckpt()
    root = _shared_dir("keep")
    t = torch.arange(4.0)  # plain tensors are saved as replicated: the same on every rank
    for step in range(1, 6):
        ckpt.save({"t": t + step}, root, step, keep=2)
        names = sorted(os.listdir(root))
        assert names == [f"step-{s:08d}" for s in range(max(1, step - 1), step + 1)], (step, names)
    # The same step again replaces it; keep=None keeps everything.
    ckpt.save({"t": t + 50}, root, 5, keep=None)
    ckpt.save({"t": t + 60}, root, 6, keep=None)
    assert [(c.step, c.complete) for c in ckpt.list_checkpoints(root)] == [(4, True), (5, True), (6, True)]
    out = {"t": torch.zeros(4)}
    assert ckpt.load_latest(out, root) == 6 and torch.equal(out["t"], t + 60)
    # A lower step saved after higher ones is kept: it is the one just written.
    ckpt.save({"t": t + 2}, root, 2, keep=1)
    assert [c.step for c in ckpt.list_checkpoints(root)] == [2]
    assert ckpt.load_latest(out, root) == 2 and torch.equal(out["t"], t + 2)


def check_incomplete_skipped():
    ckpt = _ckpt()
    root = _shared_dir("incomplete")
    t = torch.arange(6.0)
    ckpt.save({"t": t}, root, 1)
    # A save that never committed (written by dcp into its temporary directory, then
    # "crashed"), and a step directory without the commit file.
    import torch.distributed.checkpoint as dcp

    tmp = os.path.join(root, "step-00000002.tmp-0123abcd")
    dcp.save({"t": t + 1}, checkpoint_id=tmp)
    nocommit = os.path.join(root, "step-00000003")
    dcp.save({"t": t + 2}, checkpoint_id=nocommit)
    dist.barrier()
    out = {"t": torch.zeros(6)}
    step, msgs = _warned(lambda: ckpt.load_latest(out, root))
    assert step == 1 and torch.equal(out["t"], t), (step, out)
    if dist.get_rank() == 0:
        assert msgs == [
            f"fsdp_native.checkpoint: skipping incomplete checkpoint {tmp} (a save that did not finish)",
            f"fsdp_native.checkpoint: skipping incomplete checkpoint {nocommit} (no COMMITTED file)",
        ], msgs
    else:
        assert msgs == [], msgs  # rank 0 reports for everyone
    # The next save removes the unfinished save's directory; a foreign step directory stays.
    ckpt.save({"t": t + 3}, root, 4)
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000003", "step-00000004"]
    assert ckpt.load_latest(out, root) == 4 and torch.equal(out["t"], t + 3)
    # Nothing complete: None, the state dict untouched.
    empty = _shared_dir("empty")
    out = {"t": torch.zeros(6)}
    assert ckpt.load_latest(out, empty) is None and ckpt.load_latest(out, os.path.join(empty, "missing")) is None
    assert torch.equal(out["t"], torch.zeros(6))


def check_errors():
    ckpt = _ckpt()
    root = _shared_dir("errors")
    sd = {"t": torch.zeros(2)}
    cases = [
        (lambda: ckpt.save(sd, root, -1), ValueError, "argument 'step' is -1, expected a non-negative int"),
        (lambda: ckpt.save(sd, root, 1.0), ValueError, "argument 'step' is 1.0, expected a non-negative int"),
        (lambda: ckpt.save(sd, root, 1, keep=0), ValueError, "argument 'keep' is 0, expected an int >= 1 or None"),
        (lambda: ckpt.save(sd, None, 1), TypeError, "argument 'root' is None, expected a directory path"),
        (lambda: ckpt.save([1], root, 1), TypeError, "argument 'state_dict' is a list, expected a dict"),
        (lambda: ckpt.load_latest(sd, ""), TypeError, "argument 'root' is '', expected a directory path"),
        (lambda: ckpt.load_latest(None, root), TypeError, "argument 'state_dict' is a NoneType, expected a dict"),
    ]
    for fn, exc, text in cases:
        with pytest.raises(exc) as info:
            fn()
        assert text in str(info.value), str(info.value)
    assert os.listdir(root) == []


def _grid():
    run_grid(
        [dict(kind=k) for k in ("round_trip", "keep", "incomplete", "errors")],
        lambda kind: {
            "round_trip": check_round_trip,
            "keep": check_keep,
            "incomplete": check_incomplete_skipped,
            "errors": check_errors,
        }[kind](),
        name="checkpoint",
    )


def test_checkpoint_save_load_keep_incomplete():
    run_distributed(_grid, 2, timeout=180)


def test_checkpoint_without_process_group(tmp_path):
    ckpt = _ckpt()
    assert not dist.is_initialized()
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((3,), float(step))}, tmp_path, step, keep=2)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    out = {"w": torch.zeros(3)}
    assert ckpt.load_latest(out, str(tmp_path)) == 3 and torch.equal(out["w"], torch.full((3,), 3.0))


# --------------------------------------------------------------------------------------------
# Kill test. Phase A (own processes): train, save at SAVE_AT, train on (the uninterrupted run,
# recorded), then save again; rank 1's data file stops half written and the parent SIGKILLs
# rank 1 (rank 0 then fails in DCP's gather, or is killed). Phase B (the harness): fresh
# processes load the latest checkpoint and train on.

KILL_PG_TIMEOUT = 30
HALF_SIGNAL = "half_written"


def _stall_half_way(signal_path: str, target_bytes: int):
    """Makes this process's next DCP data file stop after half of `target_bytes`: the bytes are
    flushed and fsynced, `signal_path` is written, and the writer sleeps until killed."""
    from torch.distributed.checkpoint import filesystem

    orig = filesystem.FileSystem.create_stream
    half = target_bytes // 2

    class HalfFile:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            b = memoryview(b).cast("B")
            if self.n + len(b) >= half:
                self.f.write(b[: half - self.n])
                self.f.flush()
                os.fsync(self.f.fileno())
                with open(signal_path + ".tmp", "w") as s:
                    s.write(f"{self.f.name} {half}")
                os.rename(signal_path + ".tmp", signal_path)
                time.sleep(3600)
            self.n += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with orig(self, path, mode) as f:
            yield HalfFile(f) if mode == "wb" and str(path).endswith(".distcp") else f

    filesystem.FileSystem.create_stream = create_stream


def _phase_a(rank: int, world_size: int, tmpdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    status = os.path.join(tmpdir, f"phase_a_rank{rank}.txt")
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store_a"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=KILL_PG_TIMEOUT))
        ckpt, impl = _ckpt(), load_impl()
        root = os.path.join(tmpdir, "ckpt")
        model = build_fsdp(impl, CFG, make_mesh(CFG))
        opt = make_optim(CFG, model.parameters())
        train_fsdp(impl, model, CFG, opt=opt, stop=SAVE_AT)
        first = ckpt.save({"train": TrainState(model, opt)}, root, SAVE_AT)
        ref = train_fsdp(impl, model, CFG, opt=opt, start=SAVE_AT)
        torch.save({"losses": ref["losses"], "params": ref["params"]}, os.path.join(tmpdir, f"reference_rank{rank}.pt"))
        if rank == 1:
            size = os.path.getsize(os.path.join(first, f"__{rank}_0.distcp"))
            _stall_half_way(os.path.join(tmpdir, HALF_SIGNAL), size)
        dist.barrier()
        ckpt.save({"train": TrainState(model, opt)}, root, CFG.steps)
        with open(status, "w") as f:
            f.write("save returned")
    except BaseException as e:  # noqa: BLE001 - rank 0 is expected to get here
        with open(status, "w") as f:
            f.write(f"raised {type(e).__name__}\n{traceback.format_exc()}")
    os._exit(0)


def _run_phase_a(tmpdir: str, deadline_s: float = 150) -> tuple[str, int]:
    """Runs phase A, kills rank 1 half way through its data file; returns the half file's path."""
    mp = multiprocessing.get_context("spawn")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [mp.Process(target=_phase_a, args=(r, 2, tmpdir), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old

    def status(r):
        try:
            with open(os.path.join(tmpdir, f"phase_a_rank{r}.txt")) as f:
                return f.read()
        except OSError:
            return "<no status>"

    signal_path = os.path.join(tmpdir, HALF_SIGNAL)
    try:
        end = time.monotonic() + deadline_s
        while not os.path.exists(signal_path):
            dead = [r for r, p in enumerate(procs) if not p.is_alive()]
            if dead or time.monotonic() > end:
                pytest.fail(f"phase A: rank 1 never reached the half-written file (exited: {dead}); "
                            + "; ".join(f"rank {r}: {status(r)}" for r in range(2)))
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        assert procs[1].exitcode == -signal.SIGKILL, procs[1].exitcode
        procs[0].join(KILL_PG_TIMEOUT + 30)  # rank 0 fails in DCP (peer gone) or times out
        if procs[0].is_alive():
            pytest.fail("phase A: rank 0 still blocked in the save after its peer was killed")
        assert status(0).startswith("raised"), f"rank 0's save should have failed: {status(0)}"
        with open(signal_path) as f:
            path, half = f.read().split()
        return path, int(half)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _phase_b(tmpdir: str, half_file: str) -> None:
    ckpt, impl = _ckpt(), load_impl()
    root = os.path.join(tmpdir, "ckpt")
    ref = torch.load(os.path.join(tmpdir, f"reference_rank{dist.get_rank()}.pt"))
    model = build_fsdp(impl, CFG, make_mesh(CFG), seed=7)  # other weights: the load must set them all
    opt = make_optim(CFG, model.parameters())
    step, msgs = _warned(lambda: ckpt.load_latest({"train": TrainState(model, opt)}, root))
    assert step == SAVE_AT, step
    if dist.get_rank() == 0:
        partial = os.path.dirname(half_file)
        assert msgs == [f"fsdp_native.checkpoint: skipping incomplete checkpoint {partial} (a save that did not finish)"], msgs
    rest = train_fsdp(impl, model, CFG, opt=opt, start=SAVE_AT)
    assert rest["losses"] == ref["losses"], f"resumed losses {rest['losses']} != uninterrupted {ref['losses']}"
    for n, p in ref["params"].items():
        _assert_bitwise(f"final {n} after resume from the previous checkpoint", rest["params"][n], p)
    # The next save completes and clears the crashed save's directory.
    ckpt.save({"train": TrainState(model, opt)}, root, CFG.steps, keep=2)
    assert [(c.step, c.complete) for c in ckpt.list_checkpoints(root)] == [(SAVE_AT, True), (CFG.steps, True)]


def test_rank_killed_mid_save_keeps_previous_checkpoint():
    with tempfile.TemporaryDirectory(prefix="fsdp_ckpt_kill_") as tmpdir:
        half_file, half = _run_phase_a(tmpdir)
        root = os.path.join(tmpdir, "ckpt")
        # The crash left what it should: the data file half written, nothing committed.
        assert os.path.getsize(half_file) == half > 0
        partial = os.path.dirname(half_file)
        assert os.path.basename(partial).startswith(f"step-{CFG.steps:08d}.tmp-"), partial
        assert not os.path.exists(os.path.join(partial, "COMMITTED"))
        assert sorted(os.listdir(root)) == [f"step-{SAVE_AT:08d}", os.path.basename(partial)]
        run_distributed(_phase_b, 2, tmpdir, half_file, timeout=120)
