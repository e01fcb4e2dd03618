"""CUDA kernels of fsdp_native: bit-exact parity with the CPU kernels, and stream_wait
ordering. Skipped without a GPU (the CUDA build itself is checked by .ci/cuda_check.sh)."""
import subprocess
from pathlib import Path

import pytest
import torch

import fsdp_native
from fsdp_native import ops

ROOT = Path(__file__).resolve().parent.parent

cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and getattr(fsdp_native._C, "with_cuda", 0)),
    reason="needs a GPU and fsdp_native built with CUDA kernels",
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("script", [".ci/run", ".ci/cuda_check.sh"])
def test_ci_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def _params(gen, n, world_size):
    shapes = []
    for _ in range(n):
        dim0 = int(torch.randint(1, 3 * world_size + 2, (), generator=gen))
        rest = [int(torch.randint(1, 5, (), generator=gen)) for _ in range(int(torch.randint(0, 3, (), generator=gen)))]
        shapes.append([dim0, *rest])
    shapes.append([])  # a scalar
    padded = [ops.padded_shard_numel(s, world_size) for s in shapes]
    return shapes, padded


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).mul_(100).to(dtype)


def _assert_same(actual, expected):
    """Bitwise equality (NaN payloads, signed zeros) of two tensors on any devices. A 0-dim
    tensor cannot be viewed as bytes, hence the reshape to 1-D first."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = actual.detach().cpu().reshape(-1).view(torch.uint8)
    b = expected.detach().cpu().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), (actual, expected)


@pytest.mark.parametrize("dtype", FLOATS + [torch.uint8])
def test_assert_same_helper_on_cpu(dtype):
    # The helper runs on CPU tensors here, so a failure of its own (it once viewed 0-dim
    # tensors as bytes, which raises) shows without a GPU.
    for shape in [(), (0,), (1,), (3, 5)]:
        t = torch.arange(15)[: (torch.Size(shape).numel())].reshape(shape).to(dtype)
        _assert_same(t, t.clone())
    with pytest.raises(AssertionError):
        _assert_same(torch.tensor(1, dtype=dtype), torch.tensor(2, dtype=dtype))
    with pytest.raises(AssertionError):
        _assert_same(torch.zeros(2, dtype=dtype), torch.zeros(1, 2, dtype=dtype))
    if dtype.is_floating_point:  # bitwise, not numeric: -0.0 != 0.0 and NaN == same NaN
        with pytest.raises(AssertionError):
            _assert_same(torch.tensor(0.0, dtype=dtype), torch.tensor(-0.0, dtype=dtype))
        nan = torch.tensor(float("nan"), dtype=dtype)
        _assert_same(nan, nan.clone())


@cuda
@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize("dst", FLOATS)
def test_all_gather_copy_in_and_out(world_size, dst):
    gen = torch.Generator().manual_seed(world_size)
    shapes, padded = _params(gen, 6, world_size)
    rank = world_size - 1
    srcs = [_rand(s, FLOATS[i % 3], gen) for i, s in enumerate(shapes)]
    shards = [t.reshape(-1)[rank * p : (rank + 1) * p].contiguous() for t, p in zip(srcs, padded)]
    out_cpu = torch.full((sum(padded),), 7.0, dtype=dst)
    ops.all_gather_copy_in(shards, padded, out_cpu)
    out_gpu = torch.full((sum(padded),), 7.0, dtype=dst, device="cuda")
    ops.all_gather_copy_in([s.cuda() for s in shards], padded, out_gpu)
    _assert_same(out_gpu, out_cpu)

    ag = _rand((world_size * sum(padded),), dst, gen)
    outs_cpu = [torch.empty(s, dtype=FLOATS[(i + 1) % 3]) for i, s in enumerate(shapes)]
    outs_gpu = [t.cuda() for t in outs_cpu]
    ops.all_gather_copy_out(ag, padded, world_size, outs_cpu)
    ops.all_gather_copy_out(ag.cuda(), padded, world_size, outs_gpu)
    for g, c in zip(outs_gpu, outs_cpu):
        _assert_same(g, c)


@cuda
@pytest.mark.parametrize("world_size", [1, 2, 5])
@pytest.mark.parametrize("dst", FLOATS)
def test_reduce_scatter_copy_in(world_size, dst):
    gen = torch.Generator().manual_seed(10 + world_size)
    shapes, padded = _params(gen, 5, world_size)
    grads = [_rand(s, FLOATS[i % 3], gen) for i, s in enumerate(shapes)]
    out_cpu = torch.full((world_size * sum(padded),), 3.0, dtype=dst)
    out_gpu = out_cpu.cuda()
    ops.reduce_scatter_copy_in(grads, padded, world_size, out_cpu)
    ops.reduce_scatter_copy_in([g.cuda() for g in grads], padded, world_size, out_gpu)
    _assert_same(out_gpu, out_cpu)


@cuda
@pytest.mark.parametrize("divide_factor,accumulate", [(1.0, False), (4.0, False), (3.0, True), (1.0, True)])
@pytest.mark.parametrize("src", FLOATS)
def test_reduce_scatter_copy_out(divide_factor, accumulate, src):
    gen = torch.Generator().manual_seed(20)
    shapes, padded = _params(gen, 6, 4)
    shard = _rand((sum(padded),), src, gen)
    grads_cpu = [_rand([min(p, 7)], FLOATS[i % 3], gen) for i, p in enumerate(padded)]
    grads_gpu = [g.cuda() for g in grads_cpu]
    ops.reduce_scatter_copy_out(shard, padded, grads_cpu, divide_factor=divide_factor, accumulate=accumulate)
    ops.reduce_scatter_copy_out(shard.cuda(), padded, grads_gpu, divide_factor=divide_factor, accumulate=accumulate)
    for g, c in zip(grads_gpu, grads_cpu):
        _assert_same(g, c)


@cuda
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_plain_copy_byte_views_any_alignment(offset):
    # Same-dtype copies go through the widest aligned word; misalignment must fall back.
    gen = torch.Generator().manual_seed(30 + offset)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    shards = [base[offset : offset + 1000], base[2000 : 2000 + 333 + offset]]
    padded = [1024, 400]
    out_cpu = torch.full((sum(padded),), 9, dtype=torch.uint8)
    out_gpu = out_cpu.cuda()
    ops.all_gather_copy_in(shards, padded, out_cpu)
    ops.all_gather_copy_in([s.cuda() for s in shards], padded, out_gpu)
    _assert_same(out_gpu, out_cpu)


@cuda
def test_large_copy_many_blocks():
    n = (1 << 22) + 17
    shards = [torch.randn(n, device="cuda"), torch.randn(123, device="cuda")]
    padded = [n + 5, 128]
    out = torch.full((sum(padded),), 1.0, device="cuda", dtype=torch.bfloat16)
    ops.all_gather_copy_in(shards, padded, out)
    expected = torch.cat([shards[0].bfloat16(), torch.zeros(5, device="cuda", dtype=torch.bfloat16),
                          shards[1].bfloat16(), torch.zeros(5, device="cuda", dtype=torch.bfloat16)])
    assert torch.equal(out, expected)


@cuda
def test_stream_wait_orders_streams():
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # long enough that an unordered read would see zeros
        x.fill_(1.0)
    ops.stream_wait(x, main, side)
    y = x.clone()  # on main
    assert torch.equal(y, torch.ones_like(y))
    ops.stream_wait(x, side, main)  # the other direction, and default-stream ids
    ops.stream_wait(x, None, side)
    ops.stream_wait(x, main, main)
    torch.cuda.synchronize()
