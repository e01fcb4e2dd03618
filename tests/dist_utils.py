"""Multi-process test harness for the fully_shard test suite.

Design
------
* ``run_distributed(fn, world_size, ...)`` starts ``world_size`` worker processes
  once (per test function), initialises a gloo process group on a ``FileStore``
  in a fresh temporary directory and calls ``fn(*args)`` in every worker.
  The workers fork from a fork server that has imported torch (``_mp_context``),
  so a start costs little, but each still imports the test's module and builds
  its process group: a test function should run a whole grid of configurations
  inside one spawn via ``run_grid``.  ``run_distributed(preload=...)`` names more
  modules for the workers to inherit (the Hugging Face tests: transformers); the fork
  server restarts with them, and without them for the next test that names none.
* ``run_grid(configs, body)`` (called inside the workers) runs ``body(**cfg)``
  for every configuration.  A failing configuration does not stop the grid:
  each failure is sent to the parent with its traceback, all ranks agree on the
  outcome through the store (not through the process group, which may be the
  thing that is broken), and after any failure the process group is torn down
  and re-created so the next configuration starts from a clean state.
* Hangs fail instead of stalling CI: the parent joins with a deadline, kills
  the workers and fails with the configuration each rank was running plus
  a Python stack dump of every rank (``faulthandler``).  Worker crashes
  (e.g. a segfault in native code) are reported with their exit code.
* The implementation under test is selected by ``FSDP_TEST_IMPL``:
  ``fsdp_native`` (default, what the committed suite tests) or ``torch``
  (``torch.distributed.fsdp``; used to validate the harness and the tests
  themselves, where every parity test must pass trivially).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import itertools
import multiprocessing
import os
import pickle
import queue as queue_mod
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable

IMPL_ENV = "FSDP_TEST_IMPL"
DEFAULT_IMPL = "fsdp_native"
# Default per-test wall-clock limit (seconds) for one spawn, and the gloo timeout.
DEFAULT_TIMEOUT = float(os.environ.get("FSDP_TEST_TIMEOUT", "240"))
PG_TIMEOUT = float(os.environ.get("FSDP_TEST_PG_TIMEOUT", "60"))
# After one rank failed outside a grid or died, how long the others get to finish.
GRACE_AFTER_FAILURE = 20.0


# ---------------------------------------------------------------------------
# Implementation selection
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Impl:
    """Handle on one FSDP2 implementation (the one under test, or torch's)."""

    name: str
    module: Any
    fully_shard: Callable
    FSDPModule: type
    MixedPrecisionPolicy: type
    CPUOffloadPolicy: type
    OffloadPolicy: type
    unsharded_stats: Callable | None = None
    reset_unsharded_peak: Callable | None = None

    def mp(self, **kw):
        return self.MixedPrecisionPolicy(**kw)


def impl_under_test_name() -> str:
    return os.environ.get(IMPL_ENV, DEFAULT_IMPL)


def load_impl(name: str | None = None) -> Impl:
    """Import an implementation lazily.  ``name`` is 'fsdp_native' or 'torch'."""
    name = name or impl_under_test_name()
    if name == "torch":
        import torch.distributed.fsdp as m

        return Impl(
            name="torch",
            module=m,
            fully_shard=m.fully_shard,
            FSDPModule=m.FSDPModule,
            MixedPrecisionPolicy=m.MixedPrecisionPolicy,
            CPUOffloadPolicy=m.CPUOffloadPolicy,
            OffloadPolicy=m.OffloadPolicy,
            unsharded_stats=_torch_unsharded_stats,
            reset_unsharded_peak=_torch_reset_unsharded_peak,
        )
    if name == "fsdp_native":
        # A missing module or attribute must fail the test, never skip it.
        m = importlib.import_module("fsdp_native")
        missing = [
            a
            for a in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
            if not hasattr(m, a)
        ]
        if missing:
            raise AttributeError(f"fsdp_native does not export {missing} (from {m.__file__})")
        import torch.distributed.fsdp as tm

        return Impl(
            name="fsdp_native",
            module=m,
            fully_shard=m.fully_shard,
            FSDPModule=m.FSDPModule,
            MixedPrecisionPolicy=m.MixedPrecisionPolicy,
            CPUOffloadPolicy=m.CPUOffloadPolicy,
            OffloadPolicy=getattr(m, "OffloadPolicy", tm.OffloadPolicy),
            unsharded_stats=getattr(m, "unsharded_stats", None),
            reset_unsharded_peak=getattr(m, "reset_unsharded_peak", None),
        )
    # Any other importable module exposing the same API (e.g. a deliberately
    # broken wrapper, to check that the tests can fail).
    m = importlib.import_module(name)
    return Impl(
        name=name,
        module=m,
        fully_shard=m.fully_shard,
        FSDPModule=m.FSDPModule,
        MixedPrecisionPolicy=m.MixedPrecisionPolicy,
        CPUOffloadPolicy=m.CPUOffloadPolicy,
        OffloadPolicy=m.OffloadPolicy,
        unsharded_stats=getattr(m, "unsharded_stats", _torch_unsharded_stats),
        reset_unsharded_peak=getattr(m, "reset_unsharded_peak", _torch_reset_unsharded_peak),
    )


def ref_impl() -> Impl:
    """The reference implementation: always torch.distributed.fsdp."""
    return load_impl("torch")


# --- unsharded-memory accounting for torch (harness validation only) -------
# fsdp_native tracks unsharded bytes itself; for torch we reconstruct the same
# numbers by wrapping FSDPParamGroup.unshard / reshard.  A group counts as
# unsharded from the moment its all-gather is issued until it is resharded.
@dataclasses.dataclass
class _UnitStats:
    current_bytes: int = 0
    peak_bytes: int = 0
    unsharded_bytes: int = 0


@dataclasses.dataclass
class _Stats:
    current_bytes: int = 0
    peak_bytes: int = 0
    units: dict = dataclasses.field(default_factory=dict)


_TORCH_TRACK: dict = {}


def _group_unsharded_bytes(group) -> int:
    total = 0
    mp_dtype = group.mp_policy.param_dtype
    for p in group.fsdp_params:
        d = p.sharded_param.dtype
        if mp_dtype is not None and d.is_floating_point:
            d = mp_dtype
        total += p._orig_size.numel() * torch_dtype_size(d)
    return total


def torch_dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _install_torch_tracking():
    if _TORCH_TRACK.get("installed"):
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig_unshard, orig_reshard, orig_to_sharded = (
        FSDPParamGroup.unshard,
        FSDPParamGroup.reshard,
        FSDPParamGroup._to_sharded,
    )
    live: dict = {}
    _TORCH_TRACK.update(installed=True, live=live, peak={}, global_peak=[0])

    def _update():
        cur = sum(live.values())
        _TORCH_TRACK["global_peak"][0] = max(_TORCH_TRACK["global_peak"][0], cur)
        for g, b in live.items():
            _TORCH_TRACK["peak"][g] = max(_TORCH_TRACK["peak"].get(g, 0), b)

    def unshard(self, async_op=False):
        orig_unshard(self, async_op)
        if self._all_gather_result is not None or self.is_unsharded:
            live[self] = _group_unsharded_bytes(self)
            _update()

    def reshard(self):
        orig_reshard(self)
        if not self.is_unsharded:
            live.pop(self, None)

    def to_sharded(self):
        orig_to_sharded(self)
        live.pop(self, None)

    FSDPParamGroup.unshard = unshard
    FSDPParamGroup.reshard = reshard
    FSDPParamGroup._to_sharded = to_sharded


def _torch_units(module):
    from torch.distributed.fsdp import FSDPModule

    units = {}
    for fqn, m in module.named_modules():
        if isinstance(m, FSDPModule):
            units[fqn] = m._get_fsdp_state()._fsdp_param_groups
    return units


def _torch_unsharded_stats(module):
    _install_torch_tracking()
    live, peak = _TORCH_TRACK["live"], _TORCH_TRACK["peak"]
    stats = _Stats()
    for fqn, groups in _torch_units(module).items():
        u = _UnitStats()
        for g in groups:
            u.current_bytes += live.get(g, 0)
            u.peak_bytes += peak.get(g, 0)
            u.unsharded_bytes += _group_unsharded_bytes(g)
        stats.units[fqn] = u
    stats.current_bytes = sum(u.current_bytes for u in stats.units.values())
    stats.peak_bytes = _TORCH_TRACK["global_peak"][0]
    return stats


def _torch_reset_unsharded_peak(module):
    _install_torch_tracking()
    # Forget groups of other (earlier) models so they do not count towards the peak.
    mine = {g for groups in _torch_units(module).values() for g in groups}
    live = _TORCH_TRACK["live"]
    for g in [g for g in live if g not in mine]:
        del live[g]
    _TORCH_TRACK["peak"] = dict(live)
    _TORCH_TRACK["global_peak"][0] = sum(live.values())


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    tmpdir: str  # shared by all ranks of this spawn
    store: Any
    queue: Any
    pg_timeout: float = PG_TIMEOUT
    generation: int = 0
    grid_index: int = 0


_CTX: WorkerContext | None = None


def ctx() -> WorkerContext:
    assert _CTX is not None, "only valid inside a worker started by run_distributed"
    return _CTX


def _init_pg(c: WorkerContext) -> None:
    import torch.distributed as dist

    store = dist.PrefixStore(f"pg{c.generation}", c.store)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=c.rank,
        world_size=c.world_size,
        timeout=timedelta(seconds=c.pg_timeout),
    )


def _reinit_pg(c: WorkerContext) -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a broken group may fail to tear down; start fresh anyway
        pass
    c.generation += 1
    _clear_dtensor_caches()
    _init_pg(c)


def _clear_dtensor_caches() -> None:
    """Clear DTensor's sharding-propagation caches: the Python lru caches and the C++
    dispatch fast path's cache.

    They key meshes by layout (rank map, shape, names), not by process group. After the
    groups are destroyed and re-created, an op on a DTensor of a new mesh can return an output
    whose spec carries the *old* mesh, and the old mesh's group names now resolve to other,
    live groups, possibly of another size or membership. tests/test_harness.py shows an
    all-gather then running over a 4-rank group where the mesh dim has 2 ranks (issue 11: the
    suspected cause of a rare segfault inside an all-gather after a re-init)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(prop, name, None)
        # torch 2.9 wraps the first in a per-thread LocalLRUCache, whose lru cache is `.cache`
        clear = getattr(cached, "cache_clear", None) or getattr(getattr(cached, "cache", None), "cache_clear", None)
        if clear is not None:
            clear()
    # The redistribution planner's cache. On torch 2.9 and 2.10 it hands out the _MaskPartial (the
    # placement of a row-wise sharded embedding's indices) of an earlier run, while a sharding
    # propagation that missed its cache gives the output a new one: the mask goes to the first,
    # the reduction reads the second, and fails on "assert self.mask_buffer.data is not None".
    from torch.distributed.tensor import _redistribute

    clear = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    if clear is not None:
        clear()
    import torch

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # torch >= 2.10: the C++ fast path's own cache
        clear_native()


def _fmt_config(cfg: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in cfg.items()) or "<default>"


def run_grid(configs: Iterable[dict], body: Callable[..., None], name: str = "") -> None:
    """Inside a worker: run ``body(**cfg)`` for every configuration.

    Every configuration runs even if an earlier one failed; all failures are
    reported to the parent, which fails the test listing them.
    """
    import torch

    c = ctx()
    configs = list(configs)
    for cfg in configs:
        i = c.grid_index
        c.grid_index += 1
        label = (name + ": " if name else "") + _fmt_config(cfg)
        c.queue.put(("enter", c.rank, label))
        torch.manual_seed(0)
        t0 = time.perf_counter()
        ok = True
        try:
            body(**cfg)
        except BaseException as e:  # noqa: BLE001 - report everything, incl. KeyboardInterrupt
            ok = False
            c.queue.put(("fail", c.rank, label, _format_exc(e), _summary(e)))
        c.queue.put(("time", c.rank, label, time.perf_counter() - t0))
        # Agree on the outcome through the store (the process group may be broken).
        c.store.set(f"grid/{i}/{c.rank}", b"1" if ok else b"0")
        keys = [f"grid/{i}/{r}" for r in range(c.world_size)]
        c.store.wait(keys, timedelta(seconds=c.pg_timeout + 30))
        all_ok = all(c.store.get(k) == b"1" for k in keys)
        if not all_ok:
            _reinit_pg(c)


def _summary(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(e).__name__}: {text}"


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _worker_main(rank, world_size, tmpdir, wall_deadline, pg_timeout, payload, q, environ):
    global _CTX
    # A fork-server child has the server's environment and streams, not the test's: take the
    # test's environment, and write stdout/stderr to files the parent relays (_relay_output).
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(os.path.join(tmpdir, f"{name}_rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    stack_file = open(os.path.join(tmpdir, f"stacks_rank{rank}.txt"), "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    # Dump all stacks shortly before the parent gives up (it kills the workers
    # 2 s after ``wall_deadline``), so a hang shows where it is stuck.
    faulthandler.dump_traceback_later(max(wall_deadline - time.time() - 2, 1), exit=False, file=stack_file)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # A crash in a native thread (gloo's, say: issue 11's rare segfault) has no Python
        # stack: c10's handler prints every thread's C++ frames to stderr (shown with the
        # failure), then faulthandler's Python stacks follow in the stack file.
        native_stacks = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
        if native_stacks is not None:
            native_stacks(True)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        _CTX = WorkerContext(rank, world_size, tmpdir, store, q, pg_timeout)
        _init_pg(_CTX)
        fn, args, kwargs = pickle.loads(payload)  # imports the test's module, in its environment
        fn(*args, **kwargs)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put(("fail", rank, "<outside grid>", _format_exc(e), _summary(e)))
        _exit(q, rank, 1)
    faulthandler.cancel_dump_traceback_later()
    _exit(q, rank, 0)


def _exit(q, rank: int, code: int) -> None:
    q.put(("done", rank))
    q.close()
    q.join_thread()
    sys.stdout.flush()  # os._exit skips it, and stdout is a file here (_relay_output)
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------
# The workers start from a fork server that imported torch once (Python's "forkserver" start
# method with a preload), not from a fresh interpreter each: ``import torch`` and
# torch.distributed cost ~2.8 s of CPU a process, which made up about a third of the suite's
# time on 2 cores. What a fork-server child does not inherit from the test, the harness hands
# over: the test's environment (applied before the test function and its module are
# unpickled) and its stdout/stderr (each rank writes to a file, which the parent copies to
# its own streams, so pytest's capture sees it). FSDP_TEST_START=spawn restores the old way.
# A test may name more modules for its workers to inherit (``run_distributed(preload=...)``: the
# Hugging Face tests' ranks import about 9 s of CPU of transformers each); the fork server is
# then restarted with them, and restarted without them for the next test that names none, so
# every other test's workers start from torch alone, as before.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
_server_preload: list[str] | None = None  # what the running fork server preloaded


def _mp_context(preload: Iterable[str] = ()):
    global _server_preload
    method = os.environ.get("FSDP_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"FSDP_TEST_START must be 'forkserver' or 'spawn', got {method!r}")
    mp = multiprocessing.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        want = _PRELOAD + [m for m in preload if m not in _PRELOAD]
        stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's (3.8+); without it, the first preload stays
        if _server_preload is not None and want != _server_preload and stop is not None:
            stop()
            _server_preload = None
        if _server_preload is None:
            mp.set_forkserver_preload(want)
            _server_preload = want
    return mp


def _relay_output(tmpdir: str, world_size: int) -> None:
    """Copy each rank's captured stdout and stderr to this process's streams, rank by rank."""
    for rank in range(world_size):
        for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
            try:
                with open(os.path.join(tmpdir, f"{name}_rank{rank}.txt"), errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            if text:
                stream.write(text)
                stream.flush()


class DistributedTestFailure(AssertionError):
    pass


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    pg_timeout: float | None = None,
    preload: Iterable[str] = (),
    **kwargs: Any,
) -> None:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; fail the test on any failure.

    ``fn`` must be a module-level function (it is pickled by reference).
    ``timeout``: wall-clock limit of the whole spawn; ``pg_timeout``: gloo
    collective timeout (a collective a peer never joins raises after it); ``preload``:
    modules the workers inherit imported (see ``_PRELOAD``).
    """
    timeout = timeout or DEFAULT_TIMEOUT
    mp = _mp_context(preload)
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children inherit it before importing torch
    tmp = tempfile.TemporaryDirectory(prefix="fsdp_test_")
    tmpdir = tmp.name
    wall_deadline = time.time() + timeout
    payload = pickle.dumps((fn, args, kwargs))
    environ = dict(os.environ)  # with OMP_NUM_THREADS=1
    q = mp.Queue()
    procs = []
    try:
        for rank in range(world_size):
            p = mp.Process(
                target=_worker_main,
                args=(rank, world_size, tmpdir, wall_deadline, pg_timeout or PG_TIMEOUT, payload, q, environ),
                name=f"{fn.__name__}-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
    finally:
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp

    start = time.monotonic()
    deadline = start + timeout + 2  # the workers dump their stacks ~4 s before this
    grace_deadline = None
    done: set[int] = set()
    failures: list[tuple[int, str, str]] = []
    current: dict[int, str] = {}
    timings: dict[str, float] = {}
    hung: list[int] = []
    crashed: dict[int, int] = {}

    def handle(msg):
        kind = msg[0]
        if kind == "enter":
            current[msg[1]] = msg[2]
        elif kind == "fail":
            failures.append((msg[1], msg[2], msg[3], msg[4]))
        elif kind == "time":
            timings[msg[2]] = max(timings.get(msg[2], 0.0), msg[3])
        elif kind == "done":
            done.add(msg[1])

    try:
        while True:
            try:
                handle(q.get(timeout=0.05))
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if not p.is_alive() and rank not in done and rank not in crashed:
                    # Give the queue feeder a moment: 'done' may still be in flight.
                    try:
                        while True:
                            handle(q.get(timeout=0.5))
                    except queue_mod.Empty:
                        pass
                    if rank not in done:
                        crashed[rank] = p.exitcode
                        grace_deadline = grace_deadline or now + GRACE_AFTER_FAILURE
            if all(not p.is_alive() for p in procs):
                break
            if any(f[1] == "<outside grid>" for f in failures) and grace_deadline is None:
                grace_deadline = now + GRACE_AFTER_FAILURE
            if now > deadline or (grace_deadline is not None and now > grace_deadline):
                hung = [r for r, p in enumerate(procs) if p.is_alive()]
                break
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        try:
            while True:
                handle(q.get(timeout=0.1))
        except queue_mod.Empty:
            pass
        _relay_output(tmpdir, world_size)
        elapsed = time.monotonic() - start
        if os.environ.get("FSDP_TEST_VERBOSE"):
            sys.stderr.write(f"\n[{fn.__name__}] world_size={world_size} {elapsed:.1f}s\n")
            for lbl, t in timings.items():
                sys.stderr.write(f"  {t:6.2f}s  {lbl}\n")
        if failures or hung or crashed:
            report = _failure_report(fn, world_size, failures, hung, crashed, current, tmpdir, timeout, elapsed)
            try:
                import pytest
            except ImportError:
                raise DistributedTestFailure(report) from None
            pytest.fail(report, pytrace=False)
    finally:
        q.close()
        tmp.cleanup()


def _failure_report(fn, world_size, failures, hung, crashed, current, tmpdir, timeout, elapsed) -> str:
    lines = [f"{fn.__name__} (world_size={world_size}, {elapsed:.0f}s):"]
    by_label: dict[str, list[tuple[int, str, str]]] = {}
    for rank, label, tb, summary in failures:
        by_label.setdefault(label, []).append((rank, tb, summary))
    if by_label:
        lines.append(f"{len(by_label)} failing configuration(s):")
        for label, items in by_label.items():
            summaries: dict[str, list[int]] = {}
            for rank, _, summary in items:
                summaries.setdefault(summary, []).append(rank)
            for summary, ranks in summaries.items():
                lines.append(f"  - [{label}] ranks {sorted(ranks)}: {summary}")
    for rank, code in sorted(crashed.items()):
        lines.append(
            f"rank {rank} died with exit code {code} while running [{current.get(rank, '<startup>')}]"
        )
    if hung:
        lines.append(
            f"TIMEOUT: ranks {hung} still running (limit {timeout:.0f}s, or a peer failed/died); "
            f"killed. Configuration each rank was in: "
            + ", ".join(f"rank {r}: [{current.get(r, '<startup>')}]" for r in hung)
        )
    # Full tracebacks, one per (configuration, distinct message).
    for label, items in by_label.items():
        seen = set()
        for rank, tb, summary in items:
            if summary in seen:
                continue
            seen.add(summary)
            lines.append(f"\n==== [{label}] rank {rank} ====\n{tb.rstrip()}")
    if hung or crashed:
        for r in sorted(set(hung) | set(crashed)):
            path = os.path.join(tmpdir, f"stacks_rank{r}.txt")
            try:
                with open(path) as f:
                    dump = f.read().strip()
            except OSError:
                dump = ""
            if dump:
                lines.append(f"\n==== stack dump rank {r} ====\n{_trim_stack_dump(dump)}")
    return "\n".join(lines)


def _trim_stack_dump(dump: str, max_lines: int = 80) -> str:
    lines = dump.splitlines()
    return "\n".join(lines[:max_lines] + (["..."] if len(lines) > max_lines else []))


def grid(**axes: Iterable) -> list[dict]:
    """Cartesian product of the given axes as a list of config dicts."""
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(list(axes[k]) for k in keys))]


# ---------------------------------------------------------------------------
# Tensor helpers
# ---------------------------------------------------------------------------
def full(t):
    """A tensor's global value.

    A DTensor sharded over one mesh dimension (FSDP's ``Shard(0)``, HSDP's ``(Replicate(),
    Shard(0))``) is gathered with ``dist.all_gather_single`` (gloo's ``_allgather_base``),
    as bytes, its chunks padded to torch.chunk's size. Not with ``full_tensor()``: its functional
    all-gather reaches gloo's ``allgather_coalesced``, which now and then corrupts the heap of a
    gloo worker thread (issue 11's rare segfault; ``scripts/gloo_race_repro.py`` shows it with
    torch alone). Other DTensors (partial, or with tensor-subclass shards) use ``full_tensor()``.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fsdp_native import _compat  # all_gather_single on every supported torch

    if t is None:
        return None
    if not isinstance(t, DTensor):
        return t.detach().clone()
    local = t.to_local().detach()
    shards = [(m, p.dim) for m, p in enumerate(t.placements) if isinstance(p, Shard)]
    if (
        type(local) is not torch.Tensor
        or len(shards) != 1
        or not all(isinstance(p, (Shard, Replicate)) for p in t.placements)
    ):
        return t.full_tensor()
    mesh_dim, dim = shards[0]
    size, n = t.device_mesh.size(mesh_dim), t.shape[dim]
    chunk = -(-n // size)  # torch.chunk's chunk size: the last ranks may hold fewer rows or none
    rows = local.movedim(dim, 0)
    padded = rows.new_zeros((chunk, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    inp = padded.reshape(-1).view(torch.uint8)
    if inp.numel() == 0:  # nothing to gather (gloo's all-gather of 0 bytes raises SIGFPE)
        return local.new_empty(t.shape)
    out = torch.empty(size * inp.numel(), dtype=torch.uint8, device=inp.device)
    _compat.all_gather_single(out, inp, group=t.device_mesh.get_group(mesh_dim))
    gathered = out.view(local.dtype).reshape(size * chunk, *rows.shape[1:])[:n]
    return gathered.movedim(0, dim).clone()


def quantized_unsharded(w, fmt: str, ws: int, dtype=None):
    """What fsdp_native's quantized all-gather (format ``fmt``) of the full-precision ``w``,
    sharded on dim 0 over ``ws`` ranks, gives the forward in ``dtype`` (default bf16), by the
    plain-PyTorch reference: every rank's padded shard quantized, the gathered chunks
    dequantized."""
    import math

    import torch
    from fsdp_native import _quant_ref, ops

    padded = ops.padded_shard_numel(w.shape, ws)
    row = math.prod(w.shape[1:])
    flat = torch.cat([w.reshape(-1), w.new_zeros(padded * ws - w.numel())])
    chunks = [_quant_ref.quantize([flat[r * padded : (r + 1) * padded]], [padded], [row], fmt) for r in range(ws)]
    out = _quant_ref.dequantize(torch.cat(chunks), [padded], [row], ws, fmt, [w.numel()], [dtype or torch.bfloat16])[0]
    return out.view(w.shape)


_TORCH_QUANT_VALUES: dict = {}  # (module, parameter name) -> (full-precision value, format, shard ranks)


def torch_quantized_values(modules, fmt: str, shard_ws: int, quantized: Callable) -> Callable[[], int]:
    """torch FSDP2 as the reference of fsdp_native's quantized all-gather: after each of
    torch's all-gathers (forward, backward, a re-gather after an int reshard_after_forward),
    the parameters ``p`` of ``modules`` (and their submodules) with ``quantized(p)`` get
    ``quantized_unsharded`` of their step's full-precision values. Returns the function that
    takes those values from the sharded parameters (and returns how many); call it before
    each step."""
    from torch.distributed.fsdp import FSDPModule

    _install_torch_quantized_values()
    owners = [(m, n) for mod in modules for m in mod.modules() for n, p in m.named_parameters(recurse=False) if quantized(p)]

    def refresh() -> int:
        # A unit left unsharded (reshard_after_forward=False after a forward under no_grad) has
        # its unsharded tensor, which holds the quantized values, registered: take the values
        # from its sharded parameter (quantizing those again made the next all-gather's values
        # one bf16 ulp off: the fuzzing, 2026-12-07, with FSDP_FUZZ_EXACT_BF16=1).
        sharded = {}
        for mod in modules:
            for m in mod.modules():
                state = m._get_fsdp_state() if isinstance(m, FSDPModule) else None
                groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
                for fp in (fp for g in groups if g is not None for fp in g.fsdp_params):
                    sharded[(fp._module_info.module, fp._module_info.param_name)] = fp.sharded_param
        _TORCH_QUANT_VALUES.clear()
        for m, n in owners:
            _TORCH_QUANT_VALUES[(m, n)] = (full(sharded.get((m, n), getattr(m, n))), fmt, shard_ws)
        return len(owners)

    _TORCH_QUANT_VALUES.clear()
    return refresh


def _install_torch_quantized_values() -> None:
    """Once per process: torch FSDP2's ``FSDPParamGroup.wait_for_unshard`` (where an all-gather's
    values become the unsharded parameters) followed by the write of ``_TORCH_QUANT_VALUES``,
    as torch's own copy-out writes: in place, the version counter kept, so that autograd's
    saved tensors stay valid."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if getattr(FSDPParamGroup, "_quantized_values_installed", False):
        return
    orig = FSDPParamGroup.wait_for_unshard

    def wait_for_unshard(self, *args, **kwargs):
        gathered = bool(self._all_gather_result)  # else torch returns at once: nothing new
        out = orig(self, *args, **kwargs)
        for fp in self.fsdp_params if gathered else ():
            key = (fp._module_info.module, fp._module_info.param_name)
            if key in _TORCH_QUANT_VALUES:
                w, fmt, ws = _TORCH_QUANT_VALUES[key]
                p = getattr(*key)
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                    p.copy_(quantized_unsharded(w, fmt, ws, p.dtype))
        return out

    FSDPParamGroup.wait_for_unshard = wait_for_unshard
    FSDPParamGroup._quantized_values_installed = True


def rank_mean(t):
    """The mean of `t` over the ranks (a sharded run's per-rank losses, to compare with an
    unsharded run over every rank's batch)."""
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def full_params(model) -> dict:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def placements_of(model) -> dict:
    """Each parameter's DTensor placements and local shape, as text (to compare libraries)."""
    return {n: f"{p.placements} {tuple(p.to_local().shape)}" for n, p in model.named_parameters()}


def assert_close(what: str, a, b, tol: dict) -> None:
    """allclose with a message carrying the magnitude of the mismatch."""
    import torch

    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None (A: {a is None}, other: {b is None})"
        return
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    a, b = a.float(), b.float()
    if not torch.allclose(a, b, **tol):
        diff = (a - b).abs()
        rel = diff / b.abs().clamp_min(1e-12)
        raise AssertionError(
            f"{what}: max abs diff {diff.max().item():.3e}, max rel diff {rel.max().item():.3e} "
            f"(tol {tol}); A={a.flatten()[:4].tolist()} other={b.flatten()[:4].tolist()}"
        )



def assert_same_run(what: str, a: dict, b: dict, tol: dict | None = None) -> None:
    """Two training runs' ``losses`` and ``params`` (full parameters by name) agree: bit for bit,
    or within `tol`; so do their gradient ``norms`` and parameter ``placements`` where both
    runs have them."""
    tol = tol or dict(rtol=0, atol=0)
    assert_close(f"{what}: losses", a["losses"], b["losses"], tol)
    if "norms" in a and "norms" in b:
        assert_close(f"{what}: grad norms", a["norms"], b["norms"], tol)
    if "placements" in a and "placements" in b:
        assert a["placements"] == b["placements"], f"{what}: placements {a['placements']} vs {b['placements']}"
    assert a["params"].keys() == b["params"].keys(), f"{what}: parameters {sorted(a['params'])} vs {sorted(b['params'])}"
    for n in b["params"]:
        assert_close(f"{what}: {n}", a["params"][n], b["params"][n], tol)


def native_linear():
    """For checks of fsdp_native's own error messages: ``nn.Linear(4, 4)`` sharded over every
    rank by the implementation under test, or None when that is not fsdp_native."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    impl = load_impl()
    if impl.name != "fsdp_native":
        return None
    import torch.distributed as dist

    return impl.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def raises_exactly(exc_type: type, message: str, fn: Callable[[], object]) -> BaseException:
    """Runs ``fn``, which must raise ``exc_type`` with exactly ``message``; returns the error."""
    try:
        fn()
    except exc_type as e:
        assert str(e) == message, f"{exc_type.__name__} message:\n  got      {str(e)!r}\n  expected {message!r}"
        return e
    raise AssertionError(f"expected {exc_type.__name__}: {message!r}; nothing was raised")


# ---------------------------------------------------------------------------
# Frameworks in a folder of their own (torchtune, OLMo-core)
# ---------------------------------------------------------------------------
def framework_site(env_var: str, folder: str, package: str, name: str) -> str:
    """The folder ``make venv`` installs a framework into (``.venv/<folder>``, or ``$env_var``),
    which only that framework's processes put on their path; the calling test module is skipped
    where it is not installed (the oldest and newest torch's venvs)."""
    site = os.environ.get(env_var, os.path.join(sys.prefix, folder))
    if not os.path.isdir(os.path.join(site, package)):
        import pytest

        pytest.skip(f"{name} is installed by `make venv` into {site}", allow_module_level=True)
    return site


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """Arguments to ``python`` for a one-machine torchrun launch of ``script``."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script, *args]


def run_in_site(site: str, args: list[str], what: str, timeout: float = 900, **env: str) -> str:
    """``python *args`` with ``site`` first on its path, one OpenMP thread and ``env``; its output,
    once it exited 0 (else the test fails with the output's tail)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, *args], env=full_env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} failed:\n{out[-6000:]}"
    return out
