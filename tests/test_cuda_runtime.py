"""fsdp_native on a GPU against torch FSDP2: the same model trained by both in one process on a
one-rank NCCL process group. Skipped without a GPU.

* fp32: the losses of every step and the final parameters equal torch FSDP2's bit for bit
  where every parameter starts 16-byte aligned in both (the "even" model; cuBLAS may pick
  another kernel for another alignment), and within 1e-6 otherwise (the "odd" model, whose
  sizes are not multiples of 4), as the CPU parity tests allow;
* bf16 mixed precision (bf16 parameters, fp32 reduction) within bf16 rounding, trained with
  SGD (an update linear in the gradient: AdamW's first steps are about lr * sign(gradient),
  which turns a rounding difference in a gradient near zero into a difference of 2 * lr);
* with CPUOffloadPolicy() (pinned shards, checked) in both, at the same tolerances;
* with ``set_allocate_memory_from_process_group_for_comm(True)`` on every unit of both, the
  same numbers; NCCL's allocator itself through ``_comm.group_allocate`` (at one rank
  fsdp_native makes no collective buffers: it gathers and reduces in place).
Attention runs on the math SDPA backend and deterministic algorithms are on, so both
implementations run the same kernels in the same order; TF32 is off.

Each test runs in one spawned process (``run_on_gpu``: NCCL on a file store, a deadline, the
child's traceback in the failure) with a grid of configurations inside; every configuration
runs and all failures are reported together.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import tempfile
import traceback

import pytest
import torch

import fsdp_native

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and getattr(fsdp_native._C, "with_cuda", 0)),
    reason="needs a GPU and fsdp_native built with CUDA kernels",
)

TIMEOUT = float(os.environ.get("FSDP_TEST_GPU_TIMEOUT", "600"))


# ------------------------------------------------------------------------------------------
# one spawned process on a one-rank NCCL group


def _child(fn, store_path: str, q) -> None:
    # Deterministic cuBLAS needs this before the first handle is created (in this process).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
        try:
            q.put(("ok", fn()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(("error", traceback.format_exc()))


def run_on_gpu(fn, timeout: float = TIMEOUT):
    """``fn()`` (module level) in a spawned process on a one-rank NCCL group; returns its
    result, or fails the test with the child's traceback, its exit code, or a timeout."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fsdp_gpu_test_") as tmp:
        p = ctx.Process(target=_child, args=(fn, os.path.join(tmp, "store"), q), daemon=True)
        p.start()
        try:
            kind, payload = q.get(timeout=timeout)
        except queue_mod.Empty:
            pytest.fail(f"{fn.__name__}: no result after {timeout:.0f} s (exit code {p.exitcode})", pytrace=False)
        finally:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if kind != "ok":
        pytest.fail(f"{fn.__name__} failed in the GPU process:\n{payload}", pytrace=False)
    return payload


def grid_failures(configs, body) -> list[str]:
    """Runs ``body(**cfg)`` for every configuration; the failures, with tracebacks."""
    failures = []
    for cfg in configs:
        try:
            body(**cfg)
        except BaseException as e:  # noqa: BLE001
            label = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
            failures.append(f"[{label}] {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return failures


def assert_no_failures(failures: list[str]) -> None:
    if failures:
        pytest.fail(f"{len(failures)} configuration(s) failed:\n\n" + "\n\n".join(failures), pytrace=False)


# ------------------------------------------------------------------------------------------
# parity


STEPS = 3


def _impls():
    import torch.distributed.fsdp as torch_fsdp

    return {"torch": torch_fsdp, "fsdp_native": fsdp_native}


def _train(impl, args, mp: bool, reshard: bool, meta: bool, offload: bool = False, hook: bool = False,
           pg_alloc: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models import Transformer, lm_loss, make_batches

    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cuda"):
        model = Transformer(args)
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:  # shards and gradients on the CPU, pinned (the policy's default)
        kw["offload_policy"] = impl.CPUOffloadPolicy()
    for layer in model.layers:
        impl.fully_shard(layer, **kw)
    impl.fully_shard(model, **kw)
    hook_streams = []
    if hook:  # an all-reduce hook on a stream of its own: it halves each reduced gradient
        side = torch.cuda.Stream()

        def halve(out):
            hook_streams.append(torch.cuda.current_stream() == side)
            out.mul_(0.5)

        for m in [*model.layers, model]:
            m.set_all_reduce_hook(halve, stream=side)
    allocs = []
    if pg_alloc:  # collective buffers from the process group's allocator, in both implementations
        for m in [*model.layers, model]:
            m.set_allocate_memory_from_process_group_for_comm(True)
        if impl is fsdp_native:
            from fsdp_native import _comm

            orig = _comm.group_allocate

            def recording(group, size, *, dtype, device):
                allocs.append((tuple(size), dtype))
                return orig(group, size, dtype=dtype, device=device)

            _comm.group_allocate = recording
    where = "cpu" if offload else "cuda"
    if meta:  # offloaded shards are materialized on the CPU, as torch FSDP2 asks
        model.to_empty(device=where)
        torch.manual_seed(1)
        model.reset_parameters()
    assert all(isinstance(p, DTensor) and p.device.type == where for p in model.parameters())
    if offload:
        unpinned = [n for n, p in model.named_parameters() if not p.to_local().is_pinned()]
        assert not unpinned, f"{impl.__name__}: offloaded shards not in pinned memory: {unpinned}"
    # foreach=False for both: on CUDA the default picks the foreach implementation only for
    # parameters whose type is exactly Tensor or DTensor, so torch FSDP2's parameters would get
    # it and fsdp_native's (a DTensor subclass) the per-parameter loop, which rounds differently.
    if mp:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    losses = []
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for x, y in make_batches(args, STEPS, 4):
                loss = lm_loss(model(x.cuda()), y.cuda())
                loss.backward()
                assert all(p.grad is not None for p in model.parameters()), "a parameter got no gradient"
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().float().cpu())
    finally:
        if pg_alloc and impl is fsdp_native:
            _comm.group_allocate = orig
    if pg_alloc and impl is fsdp_native:
        # One rank: fsdp_native gathers and reduces in place, so no unit makes a collective
        # buffer (torch FSDP2 makes them, from NCCL's allocator here); the setting changes
        # nothing else. _pg_alloc_grid checks the allocator itself.
        assert allocs == [], allocs[:4]
    # One rank: the local shard is the whole parameter (an offloaded one is on the CPU, which
    # NCCL cannot gather).
    params = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}
    if hook:  # once per unit and backward, each time on the hook's stream
        assert hook_streams == [True] * (STEPS * (len(model.layers) + 1)), f"{impl.__name__}: {hook_streams}"
    return {"losses": torch.stack(losses), "params": params}


def _compare(model: str, mp: bool, reshard: bool, meta: bool, offload: bool = False, hook: bool = False,
             pg_alloc: bool = False) -> None:
    from models import EVEN, ODD

    args = EVEN if model == "even" else ODD
    impls = _impls()
    ref = _train(impls["torch"], args, mp, reshard, meta, offload, hook, pg_alloc)
    got = _train(impls["fsdp_native"], args, mp, reshard, meta, offload, hook, pg_alloc)
    assert got["params"].keys() == ref["params"].keys()
    if mp:  # bf16 compute: rounding differences (another kernel for another alignment) stay small
        tol = dict(rtol=2e-2, atol=1e-3)
    elif model == "even":
        tol = dict(rtol=0, atol=0)  # bit for bit
    else:
        tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["losses"], ref["losses"], **tol, msg=lambda m: f"losses: {m}")
    for name, p in ref["params"].items():
        q = got["params"][name]
        assert q.dtype == p.dtype and q.shape == p.shape, (name, q.dtype, q.shape, p.dtype, p.shape)
        torch.testing.assert_close(q, p, **tol, msg=lambda m, name=name: f"parameter {name}: {m}")


def _parity_grid() -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    configs = [
        dict(model="even", mp=False, reshard=True, meta=False),
        dict(model="even", mp=False, reshard=False, meta=True),
        dict(model="odd", mp=False, reshard=True, meta=False),
        dict(model="even", mp=True, reshard=True, meta=False),
        dict(model="odd", mp=True, reshard=False, meta=True),
        dict(model="even", mp=False, reshard=True, meta=False, offload=True),
        dict(model="even", mp=True, reshard=True, meta=True, offload=True),
        dict(model="even", mp=False, reshard=True, meta=False, hook=True),
        dict(model="even", mp=True, reshard=False, meta=False, hook=True),
    ]
    return grid_failures(configs, _compare)


@cuda
def test_parity_with_torch_fsdp2_nccl_world_size_1():
    assert_no_failures(run_on_gpu(_parity_grid))


def _pg_alloc_grid() -> list[str]:
    """set_allocate_memory_from_process_group_for_comm on NCCL: ``_comm.group_allocate``'s
    buffer (NCCL's allocator where its backend has one) works as a collective's output;
    training with the setting on matches torch FSDP2's with it on."""
    import torch.distributed as dist

    from fsdp_native import _comm

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda", 0)

    def allocator():
        group = dist.group.WORLD
        # (torch 2.11's NCCL backend on an H100 reports none for a one-rank group: then the
        # fallback, torch.empty, as torch FSDP2's allocator does)
        out = _comm.group_allocate(group, (3000,), dtype=torch.bfloat16, device=dev)  # 1-D, as the units ask
        assert out.device == dev and out.dtype == torch.bfloat16 and out.numel() == 3000, (out.device, out.dtype, out.shape)
        src = torch.arange(3000, device=dev).to(torch.bfloat16)
        dist.all_gather_into_tensor(out, src)
        assert torch.equal(out.cpu(), src.cpu())

    return grid_failures([{}], allocator) + grid_failures([
        dict(model="even", mp=False, reshard=True, meta=False, pg_alloc=True),
        dict(model="even", mp=True, reshard=False, meta=True, pg_alloc=True),
    ], _compare)


@cuda
def test_allocate_from_process_group_on_nccl():
    assert_no_failures(run_on_gpu(_pg_alloc_grid))


# ------------------------------------------------------------------------------------------
# the runtime's CUDA pieces on their own


def _streams_and_ops() -> list[str]:
    """stream_wait between the runtime's kind of streams, and a unit's copy-in / copy-out
    round trip on the device, against the CPU kernels."""
    from fsdp_native import ops

    def body():
        side = torch.cuda.Stream()
        x = torch.zeros(1 << 16, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            x.fill_(2.0)
        ops.stream_wait(x, torch.cuda.current_stream(), side)
        assert torch.equal(x.clone(), torch.full_like(x, 2.0))
        shapes = [(7, 3), (5,), (64, 64), ()]
        params = [torch.randn(s) for s in shapes]
        padded = [ops.padded_shard_numel(s, 1) for s in shapes]
        buf = torch.empty(sum(padded), dtype=torch.bfloat16, device="cuda")
        ops.all_gather_copy_in([p.reshape(-1).cuda() for p in params], padded, buf)
        outs = [torch.empty(s, device="cuda") for s in shapes]
        ops.all_gather_copy_out(buf, padded, 1, outs)
        for p, o in zip(params, outs):
            assert torch.equal(o.cpu(), p.to(torch.bfloat16).float())

    return grid_failures([{}], body)


@cuda
def test_streams_and_packing_round_trip():
    assert_no_failures(run_on_gpu(_streams_and_ops))


def _shared_streams() -> list[str]:
    """share_comm_ctx: the units of two roots use one set of CUDA streams after their first
    forward; a root left out keeps its own."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    def body():
        mesh = init_device_mesh("cuda", (1,))
        roots = []
        for _ in range(3):
            m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda()
            fsdp_native.fully_shard(m[0], mesh=mesh)
            fsdp_native.fully_shard(m, mesh=mesh)
            roots.append(m)
        fsdp_native.share_comm_ctx(roots[:2])
        for m in roots:
            m(torch.randn(2, 8, device="cuda")).sum().backward()
        streams = [m._fsdp_native_unit.streams for m in roots]
        assert streams[0].cuda and streams[0] is streams[1] and streams[0] is not streams[2], streams
        assert roots[1][0]._fsdp_native_unit.streams is streams[0], "a block unit of a sharing root"

    return grid_failures([{}], body)


@cuda
def test_share_comm_ctx_shares_streams():
    assert_no_failures(run_on_gpu(_shared_streams))


def _inputs_to_device() -> list[str]:
    """The root moves its forward inputs to its device, as torch FSDP2 does: a batch left on the
    CPU (positional, keyword, nested) gives what the same batch on the GPU gives."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, *, extra):
            return self.b(torch.relu(self.a(x))) + extra["bias"]

    def body(impl_name):
        impl = _impls()[impl_name]
        torch.manual_seed(0)
        m = Net().cuda()
        mesh = init_device_mesh("cuda", (1,))
        impl.fully_shard(m.a, mesh=mesh)
        impl.fully_shard(m, mesh=mesh)
        x, bias = torch.randn(2, 8), torch.randn(8)
        out = m(x, extra={"bias": bias})
        assert out.device.type == "cuda", out.device
        ref = m(x.cuda(), extra={"bias": bias.cuda()})
        assert torch.equal(out, ref), (out - ref).abs().max()
        out.sum().backward()
        assert m.a.weight.grad is not None

    return grid_failures([dict(impl_name=n) for n in ("torch", "fsdp_native")], body)


@cuda
def test_root_moves_inputs_to_its_device():
    assert_no_failures(run_on_gpu(_inputs_to_device))
