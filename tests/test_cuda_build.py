"""CUDA kernels of fsdp_native: bit-exact parity with the CPU kernels, and stream_wait
ordering. The GPU tests are skipped without a GPU (the CUDA build itself is checked by
.ci/cuda_check.sh); they cover the kernels' vector and scalar paths: source and destination
at every element offset mod 16 bytes, odd sizes, padding, special values (NaN payloads,
infinities, subnormals), segment tables in the kernel parameters (up to 96 segments) and in
device memory (more), and one parameter larger than 2 GiB.

Two tests run without a GPU: the byte-comparison helper itself, and the kernels' tile body
(csrc/cuda/packing_tile.cuh) compiled as host C++ and run for every tile and thread of random
plans (csrc/cuda/tile_host_test.cpp)."""
import shutil
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
f32, bf16, f16 = FLOATS


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


# ------------------------------------------------------------------------------------------
# the kernels' tile body on the host (no GPU needed)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_tile_body_on_host(tmp_path):
    exe = tmp_path / "tile_host_test"
    subprocess.run(
        ["c++", "-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
         "-Werror", "-DFSDPN_TILE_HOST_CHECKS", "-I", str(ROOT / "csrc"), str(ROOT / "csrc/cuda/tile_host_test.cpp"),
         "-o", str(exe)],
        check=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert "tile body on host: ok" in out, out


_TILE_KERNELS_CU = r"""
#include "cuda/packing_tile.cuh"
using namespace fsdp_native;
using namespace fsdp_native::tile;
template <typename S, typename D, int M>
__global__ void __launch_bounds__(kThreads) k(const __grid_constant__ InlineTable<96> t, int64_t n, float scale) {
  do_tile<S, D, M>(t, n, blockIdx.x, static_cast<int>(threadIdx.x), scale);
}
template __global__ void k<uint16_t, uint16_t, kCopy>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<uint8_t, uint8_t, kCopy>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<uint32_t, uint32_t, kCopy>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<float, bf16_t, kCopy>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<bf16_t, float, kCopy>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<bf16_t, bf16_t, kAccumulate>(const __grid_constant__ InlineTable<96>, int64_t, float);
template __global__ void k<bf16_t, float, kAccumulate>(const __grid_constant__ InlineTable<96>, int64_t, float);
"""


def _wide_loads_in_flight(sass: str) -> dict[str, int]:
    """Per kernel of `cuobjdump -sass` output: the most 8- or 16-byte global loads a thread has
    issued whose registers no later instruction has read yet (a load is in flight until then)."""
    import re

    out, name, pending, most = {}, None, {}, 0
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                out[name] = most
            name, pending, most = m.group(1), {}, 0
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m or name is None:
            continue
        text = m.group(1)
        load = re.search(r"LDG\.E\.(128|64)\S*\s+R(\d+),", text)
        operands = text.split(",", 1)[1] if load or re.match(r"(@!?P\d\s+)?(PRMT|MOV|IMAD|F2F|FADD|FMUL|HADD2|LOP3|SEL|SHF)", text) else text
        used = {int(r) for r in re.findall(r"\bR(\d+)\b", operands)}
        for first, regs in list(pending.items()):
            if used & regs:
                del pending[first]
        if load:
            first = int(load.group(2))
            pending[first] = set(range(first, first + int(load.group(1)) // 32))
            most = max(most, len(pending))
    if name:
        out[name] = most
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it: .ci/cuda_check.sh builds with it)")
def test_tile_loads_stay_in_flight(tmp_path):
    """Compiled for sm_90 (no GPU needed), every tile kernel issues its thread's kVecsPerThread
    vector loads before it reads any of them. The vector path once shared its registers with
    the element-by-element path, and for 16- and 8-bit elements the compiler split each 16-byte
    load into one register per element right after it, which waits for the load: one load in
    flight per thread. The same-dtype bf16 copies (copy-out, reduce-scatter copy-in) ran at
    72-85 % of the floor on an H100 and an H200, where the casts from fp32 sources, whose
    loads were already in flight together, ran at 96-98 %."""
    cuobjdump = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("needs triton's bundled cuobjdump")
    cu = tmp_path / "tiles.cu"
    cu.write_text(_TILE_KERNELS_CU)
    cubin = tmp_path / "tiles.cubin"
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-I", str(ROOT / "csrc"), "-o", str(cubin), str(cu)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    in_flight = _wide_loads_in_flight(sass)
    assert len(in_flight) == 7, sorted(in_flight)
    for name, most in in_flight.items():
        assert most >= 4, f"{name}: at most {most} vector loads in flight per thread"


# ------------------------------------------------------------------------------------------
# vector / scalar paths, table kinds, special values, sizes


def _special(shape, dtype, gen):
    from test_ops import make_values  # random bits, NaN payloads, infinities, subnormals, ties

    return make_values(tuple(shape), dtype, gen)


def _nan_blind(t):
    """NaNs as one value: arithmetic on NaNs (divide, accumulate) gives the device's canonical
    NaN where the CPU keeps the payload; NaN-ness must still agree."""
    if not t.is_floating_point():
        return t
    return torch.where(t.isnan(), torch.full((), float("nan"), dtype=t.dtype, device=t.device), t)


PAIRS = [(s, d) for s in FLOATS for d in FLOATS]


@cuda
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}".replace("torch.", ""))
def test_casts_special_values_bitwise(pair):
    # Conversions only (no arithmetic): bit for bit with the CPU kernels, NaN payloads included.
    src, dst = pair
    gen = torch.Generator().manual_seed(40)
    shapes = [(5000,), (3, 7), (1,), (8193,), ()]
    shards = [_special(s, src, gen).reshape(-1) for s in shapes]
    padded = [t.numel() + 3 for t in shards]
    out_cpu = torch.empty(sum(padded), dtype=dst)
    ops.all_gather_copy_in(shards, padded, out_cpu)
    out_gpu = torch.empty(sum(padded), dtype=dst, device="cuda")
    ops.all_gather_copy_in([t.cuda() for t in shards], padded, out_gpu)
    _assert_same(out_gpu, out_cpu)


@cuda
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}->{p[1]}".replace("torch.", ""))
def test_arithmetic_special_values(pair, accumulate):
    src, dst = pair
    gen = torch.Generator().manual_seed(41)
    padded = [4096 + 5, 17, 1, 3 * 8192 + 1]
    shard = _special((sum(padded),), src, gen)
    grads_cpu = [_special((p - (i % 2),), dst, gen) for i, p in enumerate(padded)]
    grads_gpu = [g.cuda() for g in grads_cpu]
    ops.reduce_scatter_copy_out(shard, padded, grads_cpu, divide_factor=3.0, accumulate=accumulate)
    ops.reduce_scatter_copy_out(shard.cuda(), padded, grads_gpu, divide_factor=3.0, accumulate=accumulate)
    for g, c in zip(grads_gpu, grads_cpu):
        _assert_same(_nan_blind(g), _nan_blind(c))


ALIGN_PAIRS = [(f32, bf16), (bf16, bf16), (bf16, f32), (f32, f32), (f16, f16), (torch.uint8, torch.uint8)]


@cuda
@pytest.mark.parametrize("pair", ALIGN_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}".replace("torch.", ""))
def test_every_alignment(pair):
    # Source and destination at every element offset modulo 16 bytes (vector loads only when
    # both line up, scalar loads into vector stores when not, scalar head and tail elements),
    # sizes around a vector and a tile; the bytes around the destination stay untouched.
    src_dt, dst_dt = pair
    gen = torch.Generator().manual_seed(42)
    per16 = 16 // torch.empty((), dtype=dst_dt).element_size()
    sizes = [1, per16 - 1, per16, per16 + 1, 8 * 1024 + 3, 3 * 32 * 1024 + 5]
    for src_off in range(per16 + 1):
        for dst_off in range(0, per16 + 1, 3):
            for n in sizes[: 4 if (src_off + dst_off) % 2 else 6]:
                base = _special((n + 64,), src_dt, gen)
                shard = base[src_off : src_off + n]
                padded = [n + 7]
                big_cpu = _special((n + 7 + 2 * per16 + 8,), dst_dt, gen)
                big_gpu = big_cpu.cuda()
                ops.all_gather_copy_in([shard], padded, big_cpu[dst_off : dst_off + n + 7])
                ops.all_gather_copy_in([base.cuda()[src_off : src_off + n]], padded, big_gpu[dst_off : dst_off + n + 7])
                _assert_same(big_gpu, big_cpu)
                # copy-out into a destination at an offset (world size 2: two segments)
                ag = _special((2 * (n + 7),), src_dt, gen)
                n_out = 2 * n + 3 if 2 * n + 3 <= 2 * (n + 7) else 2 * n
                outs_cpu = _special((n_out + dst_off + 8,), dst_dt, gen)
                outs_gpu = outs_cpu.cuda()
                ops.all_gather_copy_out(ag, padded, 2, [outs_cpu[dst_off : dst_off + n_out]])
                ops.all_gather_copy_out(ag.cuda(), padded, 2, [outs_gpu[dst_off : dst_off + n_out]])
                _assert_same(outs_gpu, outs_cpu)


@cuda
@pytest.mark.parametrize("n_params", [3, 16, 17, 96, 97, 500])
@pytest.mark.parametrize("pair", [(f32, bf16), (bf16, bf16), (bf16, f32)], ids=lambda p: f"{p[0]}->{p[1]}".replace("torch.", ""))
def test_many_small_params(n_params, pair):
    # Segment tables of both kinds: in the kernel's parameters (<= 96 segments) and uploaded
    # (more); copy-out and reduce-scatter copy-in make world_size segments of a parameter.
    src_dt, dst_dt = pair
    world_size = 8
    gen = torch.Generator().manual_seed(43 + n_params)
    shapes = [(int(torch.randint(1, 30, (), generator=gen)),) + ((3,) if i % 3 == 0 else ()) for i in range(n_params)]
    padded = [ops.padded_shard_numel(s, world_size) for s in shapes]
    rank = 5
    full = [_special(s, src_dt, gen) for s in shapes]
    shards = [t.reshape(-1)[rank * p : (rank + 1) * p].contiguous() for t, p in zip(full, padded)]
    out_cpu = torch.empty(sum(padded), dtype=dst_dt)
    out_gpu = out_cpu.cuda()
    ops.all_gather_copy_in(shards, padded, out_cpu)
    ops.all_gather_copy_in([t.cuda() for t in shards], padded, out_gpu)
    _assert_same(out_gpu, out_cpu)

    ag = _special((world_size * sum(padded),), src_dt, gen)
    outs_cpu = [torch.empty(s, dtype=dst_dt) for s in shapes]
    outs_gpu = [torch.empty(s, dtype=dst_dt, device="cuda") for s in shapes]
    ops.all_gather_copy_out(ag, padded, world_size, outs_cpu)
    ops.all_gather_copy_out(ag.cuda(), padded, world_size, outs_gpu)
    for g, c in zip(outs_gpu, outs_cpu):
        _assert_same(g, c)

    rs_cpu = torch.empty(world_size * sum(padded), dtype=dst_dt)
    rs_gpu = rs_cpu.cuda()
    ops.reduce_scatter_copy_in(full, padded, world_size, rs_cpu)
    ops.reduce_scatter_copy_in([t.cuda() for t in full], padded, world_size, rs_gpu)
    _assert_same(rs_gpu, rs_cpu)

    shard = _special((sum(padded),), src_dt, gen)
    grads_cpu = [_special((p,), dst_dt, gen) for p in padded]
    grads_gpu = [g.cuda() for g in grads_cpu]
    ops.reduce_scatter_copy_out(shard, padded, grads_cpu, divide_factor=8.0, accumulate=True)
    ops.reduce_scatter_copy_out(shard.cuda(), padded, grads_gpu, divide_factor=8.0, accumulate=True)
    for g, c in zip(grads_gpu, grads_cpu):
        _assert_same(_nan_blind(g), _nan_blind(c))


@cuda
def test_one_huge_param():
    # More than 2 GiB of source (64-bit offsets; 2^17 tiles): fp32 -> bf16 against torch's own
    # cast on the device (equal for finite values), and a plain bf16 copy.
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip(f"needs 12 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    n = (1 << 29) + 3
    src = torch.randn(n, device="cuda")
    out = torch.full((n + 13,), 7.0, dtype=bf16, device="cuda")
    ops.all_gather_copy_in([src], [n + 13], out)
    assert torch.equal(out[:n], src.to(bf16))
    assert torch.equal(out[n:], torch.zeros(13, dtype=bf16, device="cuda"))
    del src
    big = out[:n].repeat(2)  # 2^30 + 6 bf16 elements, 2 GiB
    copy = torch.empty_like(big)
    ops.all_gather_copy_in([big], [big.numel()], copy)
    assert torch.equal(copy.view(torch.int16), big.view(torch.int16))
