"""What the benchmarks share: loading an implementation, the training step, launching ranks,
timing, and a description of the machine.

* ``load_impl("torch" | "fsdp_native" | module)`` -> ``Impl`` (``fully_shard``,
  ``MixedPrecisionPolicy``, ``FSDPModule``; ``+compile``: compiled blocks);
* ``make_batch`` / ``train_step`` / ``Trainer``: the step every benchmark times (``zero_grad``,
  forward, mean-square loss against a random target of the output's shape, backward,
  ``optimizer.step``), with the phase boundaries recorded when asked;
* ``run_ranks(fn, *args)``: ``world_size`` spawned processes (gloo on CPU over a TCP store on
  localhost), each calling ``fn(rank, *args)``; what rank 0 (or every rank) returns comes back;
  a rank that raises makes the launcher raise. ``run_single(fn, *args)``: one spawned process.
  ``init_single_process_group`` / ``init_fake_process_group``: one process, world size 1 on a
  real backend, or any world size on torch's fake process group (collectives return at once
  without writing their outputs);
* ``time_cpu`` / ``time_cuda``: per-iteration times (``perf_counter``, or CUDA events),
  ``median_ms`` / ``iqr_ms``, ``max_over_ranks``;
* ``machine_info()``: CPU, cores, torch, Python, GPU name and CUDA version.

Scripts set ``OMP_NUM_THREADS`` before importing this module (it imports torch; spawned ranks
re-import the script first, so they see the same setting).
"""
from __future__ import annotations

import datetime
import functools
import importlib
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

LR = 1e-3
SEED = 0

# --------------------------------------------------------------------------------------------
# implementations


@dataclass(frozen=True)
class Impl:
    name: str
    fully_shard: Callable
    MixedPrecisionPolicy: type
    FSDPModule: type
    compile_blocks: bool = False  # torch.compile each block before fully_shard (torchtitan's order)


def load_impl(name: str) -> Impl:
    """``torch`` (torch.distributed.fsdp), ``fsdp_native``, ``fsdp_native:<format>`` (its
    quantized all-gather, e.g. ``fsdp_native:fp8_rowwise``), or any importable module exposing
    ``fully_shard``, ``MixedPrecisionPolicy`` and ``FSDPModule``; an ``@dim<d>`` suffix
    (``torch@dim1``) shards every matrix on dim d (``shard_placement_fn``) where d divides
    evenly over the ranks; a ``+compile`` suffix (``torch+compile``, ``fsdp_native+compile``)
    compiles every block before its ``fully_shard``."""
    name_, plus, extra = name.partition("+")
    if plus and extra != "compile":
        raise ValueError(f"implementation '{name}': unknown suffix '+{extra}', expected '+compile'")
    name_, at, dim = name_.partition("@")
    if at and not (dim.startswith("dim") and dim[3:].lstrip("-").isdigit()):
        raise ValueError(f"implementation '{name}': unknown suffix '@{dim}', expected '@dim<d>', e.g. '@dim1'")
    base, _, fmt = name_.partition(":")
    module = {"torch": "torch.distributed.fsdp"}.get(base, base)
    mod = importlib.import_module(module)
    fully_shard = mod.fully_shard
    if fmt:  # "fsdp_native:fp8_rowwise": fsdp_native's quantized all-gather on every unit
        fully_shard = functools.partial(mod.fully_shard, all_gather=mod.QuantizedAllGather(fmt))
    if at:
        fully_shard = functools.partial(fully_shard, shard_placement_fn=functools.partial(_shard_on, int(dim[3:])))
    return Impl(name, fully_shard, mod.MixedPrecisionPolicy, mod.FSDPModule, compile_blocks=bool(plus))


def _shard_on(dim: int, p):
    """``Shard(dim)`` for a matrix whose size on `dim` divides the world size, else dim 0."""
    from torch.distributed.tensor import Shard

    return Shard(dim) if p.dim() >= 2 and p.shape[dim] % dist.get_world_size() == 0 else None


def mixed_precision(impl: Impl, precision: str):
    """None for fp32; bf16 parameters with fp32 reduction for "bf16"."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"argument 'precision' is {precision!r}, expected 'fp32' or 'bf16'")


# --------------------------------------------------------------------------------------------
# the training step


class ResidualMLP(torch.nn.Module):
    """``x + w2(relu(w1(norm(x))))`` with ``w1``: dim -> hidden, ``w2``: hidden -> dim; the
    LayerNorm only with ``norm=True`` (then a tensor-parallel plan leaves it plain)."""

    def __init__(self, dim: int, hidden: int, norm: bool = False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim) if norm else torch.nn.Identity()
        self.w1 = torch.nn.Linear(dim, hidden)
        self.w2 = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


def make_batch(input_shape, rank: int, step: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Input and target of one rank at one step: the same for every implementation."""
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    x = torch.randn(input_shape, generator=g)
    target = torch.randn(input_shape, generator=g)
    return x.to(device), target.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def train_step(model, opt, x, target, marks: list | None = None) -> torch.Tensor:
    """zero_grad + forward + loss + backward + optimizer step. With ``marks``, appends
    ``time.perf_counter()`` after the loss and after the backward (phase boundaries)."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), target)
    if marks is not None:
        marks.append(time.perf_counter())
    loss.backward()
    if marks is not None:
        marks.append(time.perf_counter())
    opt.step()
    return loss


class Trainer:
    """One sharded model + AdamW; ``step()`` runs one timed training step after a barrier."""

    def __init__(self, impl: str, cfg, precision: str, rank: int, mesh=None):
        from benchmarks.models import build_model, shard_model

        im = load_impl(impl)
        kwargs = {} if mesh is None else {"mesh": mesh}
        self.model = shard_model(
            build_model(cfg, SEED), im.fully_shard, mixed_precision(im, precision), compile_blocks=im.compile_blocks, **kwargs
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.cfg, self.rank = cfg, rank
        self.steps = 0
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU time (all threads) of this rank
        self.phases: list[tuple[float, float, float]] = []  # zero_grad+forward+loss, backward, optimizer
        self.losses: list[float] = []

    def step(self, record: bool) -> None:
        x, target = make_batch(self.cfg.input_shape, self.rank, self.steps)
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        marks: list[float] = []
        loss = train_step(self.model, self.opt, x, target, marks)
        t3 = time.perf_counter()
        dc = time.process_time() - c0
        self.steps += 1
        self.losses.append(loss.item())
        if record:
            t1, t2 = marks
            self.times.append(t3 - t0)
            self.cpu_times.append(dc)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))


# --------------------------------------------------------------------------------------------
# process groups and launching


def quiet_warnings() -> None:
    # torch FSDP2 and fsdp_native warn that the root returns a view (the output Linear on 3-D input).
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*", category=FutureWarning)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_pg(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """A process group over a TCP store on localhost; the thread count from OMP_NUM_THREADS."""
    quiet_warnings()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )


def init_single_process_group(backend: str = "gloo") -> None:
    """World size 1 in this process (a file store in a fresh temporary directory)."""
    quiet_warnings()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def init_fake_process_group(world_size: int) -> None:
    """torch's fake process group: rank 0 of ``world_size`` in this one process. Collectives
    return at once without writing their outputs (communication time is not measured)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    quiet_warnings()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def alternate_steps(runs: dict, step: Callable[[Any], None], steps: int, warmup: int) -> dict:
    """Inside the ranks: ``step(runs[name])`` for every name in turn, the order reversed each
    step, each timed behind a barrier as the slowest rank's wall time. Returns, per name, the
    (median, min, max) ms of the steps after ``warmup``."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + steps):
        for name in names[::-1] if i % 2 == 0 else names:
            dist.barrier()
            t0 = time.perf_counter()
            step(runs[name])
            t = max_over_ranks([time.perf_counter() - t0])[0]
            if i >= warmup:
                times[name].append(t * 1e3)
    return {name: (statistics.median(v), min(v), max(v)) for name, v in times.items()}


def print_against_torch(res: dict) -> None:
    """The lines of an alternating torch / fsdp_native comparison: each median with its range,
    then the ratio and ``res["same_losses"]``."""
    for name in ("torch", "fsdp_native"):
        med, lo, hi = res[name]
        print(f"{name:11s} median {med:7.1f} ms  (range {lo:.1f}-{hi:.1f})")
    print(f"fsdp_native / torch: {res['fsdp_native'][0] / res['torch'][0]:.2f}; losses bit for bit equal: {res['same_losses']}")


def _rank_entry(rank: int, world_size: int, port: int, fn, args, queue, all_ranks: bool) -> None:
    try:
        result = fn(rank, world_size, port, *args)
        # (rank, whether a result is sent, result): every rank says when its work is done.
        queue.put((rank, True, result) if rank == 0 or all_ranks else (rank, False, None))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run_ranks(fn, *args, world_size: int = 2, all_ranks: bool = False, timeout_s: float = 7200) -> Any:
    """Spawns ``world_size`` processes running ``fn(rank, world_size, port, *args)`` (``fn`` at
    module level; ``init_pg(rank, world_size, port)`` joins them). Returns rank 0's result, or
    with ``all_ranks`` the list of every rank's, in rank order. Raises if a rank fails."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args, queue, all_ranks))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    n_results = world_size if all_ranks else 1
    results: dict[int, Any] = {}
    done: set[int] = set()  # ranks whose work is done
    deadline = time.monotonic() + timeout_s
    name = getattr(fn, "__name__", str(fn))

    def receive(timeout: float) -> None:
        rank, has_result, res = queue.get(timeout=timeout)
        done.add(rank)
        if has_result:
            results[rank] = res

    try:
        while len(results) < n_results:
            try:
                receive(1.0)
            except Exception:  # queue.Empty
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                while failed and not set(failed) <= done:  # what they sent before exiting may still be on its way
                    try:
                        receive(1.0)
                    except Exception:  # queue.Empty
                        break
                if not set(failed) <= done:  # a rank failed before its work was done
                    raise RuntimeError(f"{name}: a rank failed (see its traceback above)") from None
                if all(p.exitcode is not None for p in procs) and queue.empty():
                    raise RuntimeError(f"{name}: ranks exited without results") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no result after {timeout_s:.0f} s") from None
        for p in procs:
            p.join()
        for r, p in enumerate(procs):
            if p.exitcode != 0:  # the results came, but the process failed on its way out
                print(f"{name}: rank {r} exited with code {p.exitcode} after the results were in "
                      "(a failure at exit; its stderr is above)", file=sys.stderr, flush=True)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    return [results[r] for r in range(world_size)] if all_ranks else results[0]


def _single_entry(fn, args, queue) -> None:
    try:
        queue.put(fn(*args))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def run_single(fn, *args, timeout_s: float = 3600) -> Any:
    """``fn(*args)`` in one fresh spawned process; returns its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_single_entry, args=(fn, args, queue))
    p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return queue.get(timeout=1.0)
            except Exception:  # queue.Empty
                if p.exitcode not in (None, 0) or time.monotonic() > deadline:
                    raise RuntimeError(f"{getattr(fn, '__name__', fn)}: the process failed") from None
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
            p.join()


# --------------------------------------------------------------------------------------------
# timing


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def iqr_ms(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (1e3 * xs[0],) * 2
    q = statistics.quantiles(xs, n=4)
    return 1e3 * q[0], 1e3 * q[2]


def time_cpu(fn: Callable[[], Any], iters: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``iters`` calls (perf_counter), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int = 1, reps: int = 1, queue_ahead: bool = False) -> list[float]:
    """Seconds per call of ``fn`` on the current CUDA stream, from CUDA events around
    ``reps`` back-to-back calls, ``iters`` times (after ``warmup`` untimed calls).

    With ``queue_ahead`` a long sleep kernel is queued first, so the host has queued all
    ``reps`` calls before the device starts them: the time is then the device's alone,
    without the host's launch overhead (for ops too short to hide it). The sleep lasts about
    twice what queueing ``reps`` calls took the host once (at least ~1 ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    sleep_cycles = 2_000_000  # ~1 ms at ~2 GHz
    if queue_ahead:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sleep_cycles = max(sleep_cycles, int((time.perf_counter() - t0) * 4e9))  # 2x, at ~2 GHz
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue_ahead:
            torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return out


# --------------------------------------------------------------------------------------------
# machine


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict:
    info = {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": None,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        free, total = torch.cuda.mem_get_info()
        info["gpu_memory_gib"] = round(total / 2**30, 1)
    return info


def describe_machine(info: dict | None = None) -> str:
    i = info or machine_info()
    gpu = f"; GPU {i['gpu']} ({i.get('gpu_memory_gib')} GiB), CUDA {i['cuda']}" if i.get("gpu") else ""
    return f"{i['machine']}, {i['cores']} cores ({i['cpu']}), torch {i['torch']}, Python {i['python']}{gpu}"
