"""The packing ops (fsdp_native.ops) against plain-torch references, on CPU.

* a grid: every op x dtype pair (float32 / bfloat16 / float16 casts, same-dtype uint8 and int8
  byte views) x world sizes 1..8 x awkward shapes (numel not divisible by the world size,
  zero-size, one element, 0-dim, dim 0 smaller than the world size); values include NaNs with
  payloads, infinities, subnormals, rounding ties and overflow, and casts must equal torch's
  ``.to(dtype)`` bit for bit;
* a mixed-dtype unit packed through uint8 byte views, units of 1 to 1000 tensors, and copies
  large enough to be multithreaded and streamed;
* hypothesis: copy-in on every simulated rank + all-gather (torch.cat) + copy-out gives back the
  parameters; reduce-scatter copy-in on every rank + sum-reduce-scatter + copy-out (divide
  factor, accumulate) equals the reference;
* torch.library.opcheck on every op; bad arguments raise RuntimeError with an exact message.
"""
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_native import ops

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (f32, bf16, f16)
BYTE_DTYPES = (torch.uint8, torch.int8)
PAIRS = [(s, d) for s in FLOATS for d in FLOATS] + [(b, b) for b in BYTE_DTYPES]
WORLD_SIZES = range(1, 9)
# Awkward shapes: 0-dim, one element, zero-size, dim 0 < world size, numel not divisible.
EDGE_SHAPES = [(), (1,), (0,), (0, 4), (4, 0), (3, 5), (7,), (2, 3, 4), (13, 1), (9, 2), (17,)]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _pid(dtype):
    return str(dtype).replace("torch.", "")


def pair_id(pair):
    return f"{_pid(pair[0])}->{_pid(pair[1])}"


# ----------------------------------------------------------------------------- values

_SPECIAL_BITS = {
    f32: [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFC12345, 0x7FFFFFFF,  # NaNs
        0x00000001, 0x807FFFFF, 0x00400000, 0x007FFFFF, 0x00800000,  # subnormals, FLT_MIN
        0x7F7FFFFF, 0xFF7FFFFF,  # FLT_MAX
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,  # bfloat16 ties / near ties
        0x477FE000, 0x477FF000, 0x477FEFFF, 0x47800000,  # float16 max, overflow to inf
        0x33800000, 0x33000000, 0x33400000, 0x387FC000, 0x38800000, 0x3A801000,  # f16 subnormal
    ],
    f16: [
        0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D23, 0xFFFF,
        0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x3C01, 0x0200,
    ],
    bf16: [
        0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FA3, 0xFFFF,
        0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0x3F81, 0x477F, 0x4780, 0x3380,
        0x3300, 0x3340,
    ],
}


def _bits_tensor(values, dtype):
    it = _INT_VIEW[torch.empty((), dtype=dtype).element_size()]
    v = torch.tensor(values, dtype=torch.int64)
    if it == torch.int16:
        v = torch.where(v >= 2**15, v - 2**16, v)
    elif it == torch.int32:
        v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(it).view(dtype)


def make_values(shape, dtype, gen, special=True):
    """Random values of ``dtype``; for floats, with random bit patterns and special values
    (NaN payloads, infinities, subnormals, ties, overflow) mixed in when ``special``."""
    n = math.prod(shape)
    if dtype in BYTE_DTYPES:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)
    scale = torch.pow(2.0, torch.randint(-20, 20, (n,), generator=gen).double())
    x = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if special and n:
        es = x.element_size()
        it = _INT_VIEW[es]
        raw = torch.randint(-(2 ** (8 * es - 1)), 2 ** (8 * es - 1), (n,), generator=gen, dtype=torch.int64)
        xb = x.view(it)
        pick = torch.rand(n, generator=gen) < 0.25
        xb[pick] = raw.to(it)[pick]
        spec = _bits_tensor(_SPECIAL_BITS[dtype], dtype).view(it)
        idx = torch.randint(0, spec.numel(), (n,), generator=gen)
        pick = torch.rand(n, generator=gen) < 0.25
        xb[pick] = spec[idx][pick]
        x = xb.view(dtype)
    return x.reshape(shape)


def bits(t):
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def assert_bitwise(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.numel() == expected.numel(), (actual.shape, expected.shape)
    a, e = bits(actual).reshape(-1), bits(expected).reshape(-1)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().flatten()
        i = bad[0].item()
        raise AssertionError(
            f"{bad.numel()} of {a.numel()} elements differ; first at {i}: "
            f"got bits {a[i].item():#x}, expected {e[i].item():#x}"
        )


def assert_cast(actual, expected, src_dtype):
    """A cast from ``src_dtype`` equals torch's ``.to`` (of a contiguous tensor: strided ones
    take a scalar path with other NaN bits) bit for bit, NaN bits included, except
    float16 -> float32 NaNs: torch writes them two ways itself, keeping the payload (F16C) in
    its vectorised body but as 0x7fffffff in the scalar tail (the last numel % 8 elements), so
    only NaN-ness is compared there. (test_casts_bitwise_exhaustive_16bit checks that pair's
    NaN bits against torch's vectorised path.)"""
    if src_dtype == f16 and actual.dtype == f32:
        assert_equal_arith(actual, expected)
    else:
        assert_bitwise(actual, expected)


def assert_equal_arith(actual, expected):
    """Bitwise equal, except that NaNs only need to be NaN (payload propagation through
    arithmetic depends on operand order)."""
    if actual.is_floating_point():
        an, en = actual.isnan(), expected.isnan()
        assert torch.equal(an, en), "NaN positions differ"
        actual = torch.where(an, torch.zeros((), dtype=actual.dtype), actual)
        expected = torch.where(en, torch.zeros((), dtype=expected.dtype), expected)
    assert_bitwise(actual, expected)


# ----------------------------------------------------------------------------- references


def cast(t, dtype):
    """torch's ``.to(dtype)`` on the flat contiguous data: a 0-dim or strided tensor would take
    torch's scalar path, which writes other NaN bits (0x7fc0 for bfloat16) than its vectorised
    one; the ops work on flat contiguous buffers."""
    return t.contiguous().reshape(-1).to(dtype).reshape(t.shape)


def shard_of(t, world_size, rank):
    """Rank ``rank``'s dim-0 shard (contiguous), as FSDP2 chunks dim 0; a 0-dim tensor is one
    row held by rank 0."""
    if t.dim() == 0:
        flat = t.reshape(1)
        return flat if rank == 0 else flat[1:]
    rows = -(-t.shape[0] // world_size)
    return t[rank * rows : (rank + 1) * rows]


def ref_copy_in(shards, padded, dtype):
    parts = []
    for s, p in zip(shards, padded):
        z = torch.zeros(p, dtype=dtype)
        z[: s.numel()] = cast(s.reshape(-1), dtype)
        parts.append(z)
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def ref_copy_out(ag, padded, world_size, likes):
    ag2 = ag.view(world_size, -1)
    outs, off = [], 0
    for like, p in zip(likes, padded):
        col = ag2[:, off : off + p].reshape(-1)[: like.numel()]
        outs.append(cast(col, like.dtype).reshape(like.shape))
        off += p
    return outs


def ref_rs_copy_in(grads, padded, world_size, dtype):
    cols = []
    for g, p in zip(grads, padded):
        z = torch.zeros(world_size * p, dtype=dtype)
        z[: g.numel()] = cast(g.reshape(-1), dtype)
        cols.append(z.view(world_size, p))
    if not cols:
        return torch.empty(0, dtype=dtype)
    return torch.cat(cols, dim=1).reshape(-1)


def _scale32(divide_factor):
    return torch.tensor(1.0 / divide_factor, dtype=f32)


def ref_rs_copy_out(shard, padded, grads_before, divide_factor, accumulate):
    outs, off = [], 0
    for g, p in zip(grads_before, padded):
        v = shard[off : off + g.numel()].reshape(g.shape)
        if accumulate:
            outs.append(cast(cast(g, f32) + cast(v, f32) * _scale32(divide_factor), g.dtype))
        elif divide_factor != 1.0:
            outs.append(cast(cast(v, f32) * _scale32(divide_factor), g.dtype))
        else:
            outs.append(cast(v, g.dtype))
        off += p
    return outs


def padded_of(shapes, world_size):
    return [ops.padded_shard_numel(s, world_size) for s in shapes]


# ----------------------------------------------------------------------------- grid


def _grid_tensors(pair, world_size, seed):
    gen = torch.Generator().manual_seed(seed)
    src, dst = pair
    return gen, [make_values(s, src, gen) for s in EDGE_SHAPES]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_all_gather_copy_in_grid(pair, world_size):
    src, dst = pair
    gen, params = _grid_tensors(pair, world_size, 1)
    padded = padded_of(EDGE_SHAPES, world_size)
    for rank in range(world_size):
        shards = [shard_of(p, world_size, rank) for p in params]
        out = make_values((sum(padded),), dst, gen)  # garbage: padding must be zeroed
        ops.all_gather_copy_in(shards, padded, out)
        assert_cast(out, ref_copy_in(shards, padded, dst), src)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_all_gather_copy_out_grid(pair, world_size):
    src, dst = pair  # all-gather dtype -> parameter dtype
    gen = torch.Generator().manual_seed(2)
    padded = padded_of(EDGE_SHAPES, world_size)
    ag = make_values((world_size * sum(padded),), src, gen)
    outs = [make_values(s, dst, gen) for s in EDGE_SHAPES]
    ops.all_gather_copy_out(ag, padded, world_size, outs)
    for o, r in zip(outs, ref_copy_out(ag, padded, world_size, outs)):
        assert_cast(o, r, src)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_reduce_scatter_copy_in_grid(pair, world_size):
    src, dst = pair  # gradient dtype -> reduce dtype
    gen, grads = _grid_tensors(pair, world_size, 3)
    padded = padded_of(EDGE_SHAPES, world_size)
    out = make_values((world_size * sum(padded),), dst, gen)
    ops.reduce_scatter_copy_in(grads, padded, world_size, out)
    assert_cast(out, ref_rs_copy_in(grads, padded, world_size, dst), src)


# Arithmetic (divide_factor != 1, accumulate) needs floating dtypes (see test_bad_dtype_pair).
_RS_OUT_MODES = [(1.0, False), (8.0, False), (3.0, False), (1.0, True), (6.0, True)]
_RS_OUT_GRID = [
    (pair, df, acc) for pair in PAIRS for df, acc in _RS_OUT_MODES if pair[0] in FLOATS or (df == 1.0 and not acc)
]


@pytest.mark.parametrize("world_size", [1, 3, 8])
@pytest.mark.parametrize(
    "pair,divide_factor,accumulate", _RS_OUT_GRID, ids=lambda x: pair_id(x) if isinstance(x, tuple) else str(x)
)
def test_reduce_scatter_copy_out_grid(pair, world_size, divide_factor, accumulate):
    src, dst = pair  # reduce dtype -> gradient dtype
    arithmetic = accumulate or divide_factor != 1.0
    gen = torch.Generator().manual_seed(4)
    shapes = [shard_of(torch.empty(s), world_size, 0).shape for s in EDGE_SHAPES]
    padded = padded_of(EDGE_SHAPES, world_size)
    shard = make_values((sum(padded),), src, gen)
    grads = [make_values(s, dst, gen) for s in shapes]
    before = [g.clone() for g in grads]
    ops.reduce_scatter_copy_out(shard, padded, grads, divide_factor=divide_factor, accumulate=accumulate)
    for g, r in zip(grads, ref_rs_copy_out(shard, padded, before, divide_factor, accumulate)):
        if arithmetic:
            assert_equal_arith(g, r)
        else:
            assert_cast(g, r, src)


def test_casts_bitwise_exhaustive_16bit():
    """Every float16 and bfloat16 bit pattern, cast to the other float dtypes, equals torch's
    `.to` bit for bit, NaNs included (numel a multiple of 64: torch's vectorised path
    throughout); and float32 specials to both."""
    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    srcs = [all16.view(f16), all16.view(bf16), _bits_tensor(_SPECIAL_BITS[f32] * 7, f32)]
    for x in srcs:
        for dst in FLOATS:
            out = torch.empty(x.numel(), dtype=dst)
            ops.all_gather_copy_in([x], [x.numel()], out)
            assert_bitwise(out, x.to(dst))


# ----------------------------------------------------------------------------- byte views


def test_mixed_dtype_unit_through_byte_views():
    """A unit of packed 4-bit weights (uint8) next to their float32 scales and a bfloat16 norm,
    all as uint8 byte views (rows kept whole), round-trips through copy-in / all-gather /
    copy-out bit for bit, and reduce-scatter copy-in / copy-out moves its bytes exactly."""
    gen = torch.Generator().manual_seed(5)
    world_size = 3
    qweight = torch.randint(0, 256, (37, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = make_values((37, 2), f32, gen)
    norm = make_values((11, 1), bf16, gen)
    params = [qweight, scales, norm]

    def byte_view(t):
        return t.view(torch.uint8)  # last dim scaled by the element size, rows kept

    byte_params = [byte_view(p) for p in params]
    padded = padded_of([b.shape for b in byte_params], world_size)
    assert padded[1] == 13 * 8 and padded[2] == 4 * 2
    chunks = []
    for rank in range(world_size):
        shards = [shard_of(b, world_size, rank) for b in byte_params]
        out = torch.empty(sum(padded), dtype=torch.uint8)
        ops.all_gather_copy_in(shards, padded, out)
        assert_bitwise(out, ref_copy_in(shards, padded, torch.uint8))
        chunks.append(out)
    ag = torch.cat(chunks)
    outs = [torch.empty_like(p) for p in params]
    ops.all_gather_copy_out(ag, padded, world_size, [byte_view(o) for o in outs])
    for o, p in zip(outs, params):
        assert_bitwise(o, p)

    rs_in = torch.empty(world_size * sum(padded), dtype=torch.uint8)
    ops.reduce_scatter_copy_in(byte_params, padded, world_size, rs_in)
    assert_bitwise(rs_in, ref_rs_copy_in(byte_params, padded, world_size, torch.uint8))
    for rank in range(world_size):
        grads = [torch.empty_like(shard_of(p, world_size, rank)) for p in params]
        chunk = rs_in.view(world_size, -1)[rank]
        ops.reduce_scatter_copy_out(chunk, padded, [byte_view(g) for g in grads])
        for g, p in zip(grads, params):
            assert_bitwise(g, shard_of(p, world_size, rank))


# ----------------------------------------------------------------------------- unit sizes


@pytest.mark.parametrize("n_tensors,world_size,pair", [(1, 8, (f32, bf16)), (7, 5, (bf16, f32)), (1000, 3, (f32, bf16)), (1000, 8, (bf16, bf16))])
def test_units_of_1_to_1000_tensors(n_tensors, world_size, pair):
    src, dst = pair
    gen = torch.Generator().manual_seed(n_tensors * 10 + world_size)
    dims = torch.randint(0, 12, (n_tensors, 2), generator=gen).tolist()
    shapes = [tuple(d[: 1 + (i % 2)]) for i, d in enumerate(dims)]
    params = [make_values(s, src, gen) for s in shapes]
    padded = padded_of(shapes, world_size)
    chunks = []
    for rank in range(world_size):
        shards = [shard_of(p, world_size, rank) for p in params]
        out = torch.empty(sum(padded), dtype=dst)
        ops.all_gather_copy_in(shards, padded, out)
        assert_bitwise(out, ref_copy_in(shards, padded, dst))
        chunks.append(out)
    ag = torch.cat(chunks)
    outs = [torch.empty(s, dtype=src) for s in shapes]
    ops.all_gather_copy_out(ag, padded, world_size, outs)
    for o, p in zip(outs, params):
        assert_bitwise(o, cast(cast(p, dst), src))
    rs_in = torch.empty(world_size * sum(padded), dtype=dst)
    ops.reduce_scatter_copy_in(params, padded, world_size, rs_in)
    assert_bitwise(rs_in, ref_rs_copy_in(params, padded, world_size, dst))


@pytest.mark.parametrize("threads", [1, 2])
def test_large_multithreaded_streamed(threads):
    """Copies big enough to be split over threads mid-segment and written with streaming
    stores (>= 4 MiB), at odd offsets so every segment has an unaligned head and tail."""
    gen = torch.Generator().manual_seed(6)
    world_size = 3
    shapes = [(1001, 1003), (5,), (517, 999), (3, 7)]
    params = [make_values(s, f32, gen, special=False) for s in shapes]
    padded = padded_of(shapes, world_size)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chunks = []
        for rank in range(world_size):
            shards = [shard_of(p, world_size, rank) for p in params]
            out = torch.empty(sum(padded) + 1, dtype=bf16)[1:]  # dst 2 bytes off alignment
            ops.all_gather_copy_in(shards, padded, out)
            assert_bitwise(out, ref_copy_in(shards, padded, bf16))
            chunks.append(out)
        ag = torch.cat(chunks)
        outs = [torch.empty(s, dtype=f32) for s in shapes]
        ops.all_gather_copy_out(ag, padded, world_size, outs)
        for o, p in zip(outs, params):
            assert_bitwise(o, cast(cast(p, bf16), f32))
        for dst in (f32, bf16):  # same dtype (memcpy) and cast
            rs_in = torch.empty(world_size * sum(padded), dtype=dst)
            ops.reduce_scatter_copy_in(params, padded, world_size, rs_in)
            assert_bitwise(rs_in, ref_rs_copy_in(params, padded, world_size, dst))
        shard = make_values((sum(padded) * 2,), f32, gen, special=False)
        grads = [torch.empty_like(shard_of(p, world_size, 0)) for p in params]
        ops.reduce_scatter_copy_out(shard, [2 * p for p in padded], grads, divide_factor=3.0)
        for g, r in zip(grads, ref_rs_copy_out(shard, [2 * p for p in padded], grads, 3.0, False)):
            assert_bitwise(g, r)
    finally:
        torch.set_num_threads(prev)


def test_empty_unit():
    ops.all_gather_copy_in([], [], torch.empty(0))
    ops.all_gather_copy_out(torch.empty(0), [], 4, [])
    ops.reduce_scatter_copy_in([], [], 4, torch.empty(0))
    ops.reduce_scatter_copy_out(torch.empty(0), [], [], divide_factor=2.0, accumulate=True)


# ----------------------------------------------------------------------------- property


@st.composite
def units(draw):
    world_size = draw(st.integers(1, 8))
    n = draw(st.integers(1, 8))
    shapes = []
    for _ in range(n):
        ndim = draw(st.integers(0, 3))
        dim0 = draw(st.integers(0, 20))
        rest = [draw(st.integers(0, 5)) for _ in range(max(ndim - 1, 0))]
        shapes.append(tuple([dim0] + rest) if ndim else ())
    param_dtype = draw(st.sampled_from(FLOATS))
    comm_dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**31 - 1))
    return world_size, shapes, param_dtype, comm_dtype, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units())
def test_property_all_gather_round_trip(unit):
    world_size, shapes, param_dtype, comm_dtype, seed = unit
    gen = torch.Generator().manual_seed(seed)
    params = [make_values(s, param_dtype, gen) for s in shapes]
    padded = padded_of(shapes, world_size)
    chunks = []
    for rank in range(world_size):  # copy-in on every simulated rank
        out = torch.empty(sum(padded), dtype=comm_dtype)
        ops.all_gather_copy_in([shard_of(p, world_size, rank) for p in params], padded, out)
        chunks.append(out)
    all_gather_output = torch.cat(chunks)  # simulated all-gather
    outs = [torch.empty(s, dtype=param_dtype) for s in shapes]
    ops.all_gather_copy_out(all_gather_output, padded, world_size, outs)
    for o, p in zip(outs, params):
        if comm_dtype == param_dtype:
            assert_bitwise(o, p)  # the original parameter, bit for bit
        elif (param_dtype, comm_dtype) == (f16, f32):
            # Lossless through float32, but NaNs come back quiet (as with F16C).
            quiet = torch.where(p.isnan(), bits(p) | 0x200, bits(p)).view(f16)
            assert_bitwise(o, quiet)
        else:
            assert_cast(o, cast(cast(p, comm_dtype), param_dtype), comm_dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units(),
    st.sampled_from([1.0, 2.0, 3.0, 8.0, 0.5, 6.0]),
    st.booleans(),
)
def test_property_reduce_scatter(unit, divide_factor, accumulate):
    world_size, shapes, grad_dtype, reduce_dtype, seed = unit
    gen = torch.Generator().manual_seed(seed)
    padded = padded_of(shapes, world_size)
    # Every rank has its own unsharded gradients (finite values: sums of NaNs are not the point).
    grads = [[make_values(s, grad_dtype, gen, special=False) for s in shapes] for _ in range(world_size)]
    rs_inputs = []
    for rank in range(world_size):
        rs_in = torch.empty(world_size * sum(padded), dtype=reduce_dtype)
        ops.reduce_scatter_copy_in(grads[rank], padded, world_size, rs_in)
        rs_inputs.append(rs_in.view(world_size, -1))
    # Simulated sum reduce-scatter: accumulate ranks in order in float32, output in reduce dtype.
    acc = torch.zeros(world_size, sum(padded), dtype=f32)
    for x in rs_inputs:
        acc += x.float()
    reduced = acc.to(reduce_dtype)
    # Independent expectation: the sum of the ranks' full gradients, sharded.
    full_sums = []
    for i in range(len(shapes)):
        s = torch.zeros(shapes[i], dtype=f32)
        for rank in range(world_size):
            s += grads[rank][i].to(reduce_dtype).float()
        full_sums.append(s.to(reduce_dtype))
    scale = _scale32(divide_factor)
    for rank in range(world_size):
        sharded = [make_values(shard_of(torch.empty(s), world_size, rank).shape, grad_dtype, gen, special=False) for s in shapes]
        before = [g.clone() for g in sharded]
        ops.reduce_scatter_copy_out(reduced[rank], padded, sharded, divide_factor=divide_factor, accumulate=accumulate)
        for g, b, fs in zip(sharded, before, full_sums):
            v = shard_of(fs, world_size, rank).reshape(b.shape)
            if accumulate:
                expected = cast(cast(b, f32) + cast(v, f32) * scale, grad_dtype)
            elif divide_factor != 1.0:
                expected = cast(cast(v, f32) * scale, grad_dtype)
            else:
                expected = cast(v, grad_dtype)
            assert_equal_arith(g, expected)


# ----------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    gen = torch.Generator().manual_seed(7)
    shapes, ws = [(5, 3), (2,), (0,)], 2
    padded = padded_of(shapes, ws)
    params = [make_values(s, f32, gen, special=False) for s in shapes]
    shards = [shard_of(p, ws, 1) for p in params]
    yield "all_gather_copy_in", (shards, padded, torch.empty(sum(padded), dtype=bf16))
    ag = make_values((ws * sum(padded),), bf16, gen, special=False)
    yield "all_gather_copy_out", (ag, padded, ws, [torch.empty(s) for s in shapes])
    yield "reduce_scatter_copy_in", (params, padded, ws, torch.empty(ws * sum(padded), dtype=bf16))
    shard = make_values((sum(padded),), bf16, gen, special=False)
    grads = [torch.zeros(shard_of(p, ws, 0).shape) for p in params]
    yield "reduce_scatter_copy_out", (shard, padded, 2.0, True, grads)
    yield "stream_wait", (torch.empty(3), 0, 0)


@pytest.mark.parametrize("name,args", list(_opcheck_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.fsdp_native, name).default, args)


def test_stream_wait_cpu_is_noop():
    anchor = torch.arange(4.0)
    ops.stream_wait(anchor, None, None)
    assert torch.equal(anchor, torch.arange(4.0))


# ----------------------------------------------------------------------------- bad input


def raises(msg):
    """pytest.raises for a RuntimeError whose message is exactly ``msg`` (a C++ stack trace,
    when TORCH_SHOW_CPP_STACKTRACES=1, may follow on the next lines)."""
    return pytest.raises(RuntimeError, match=f"^{re.escape(msg)}(\n|$)")


AG_IN, AG_OUT = "fsdp_native::all_gather_copy_in", "fsdp_native::all_gather_copy_out"
RS_IN, RS_OUT = "fsdp_native::reduce_scatter_copy_in", "fsdp_native::reduce_scatter_copy_out"


def test_wrong_buffer_size():
    with raises(f"{AG_IN}: argument 'out' has 9 elements, expected 8 (the sum of padded_numels)"):
        ops.all_gather_copy_in([torch.ones(3), torch.ones(2)], [5, 3], torch.empty(9))
    with raises(f"{AG_OUT}: argument 'all_gather_output' has 15 elements, expected 16 (world_size 2 x sum of padded_numels 8)"):
        ops.all_gather_copy_out(torch.empty(15), [5, 3], 2, [torch.empty(10), torch.empty(6)])
    with raises(f"{RS_IN}: argument 'out' has 17 elements, expected 16 (world_size 2 x sum of padded_numels 8)"):
        ops.reduce_scatter_copy_in([torch.ones(10), torch.ones(6)], [5, 3], 2, torch.empty(17))
    with raises(f"{RS_OUT}: argument 'shard' has 7 elements, expected 8 (the sum of padded_numels)"):
        ops.reduce_scatter_copy_out(torch.empty(7), [5, 3], [torch.empty(5), torch.empty(3)])


def test_non_contiguous():
    with raises(f"{AG_IN}: argument 'out' must be contiguous, got a tensor with sizes [4] and strides [2]"):
        ops.all_gather_copy_in([torch.ones(4)], [4], torch.empty(8)[::2])
    with raises(f"{AG_IN}: argument 'shards[1]' must be contiguous, got a tensor with sizes [2, 3] and strides [1, 2]"):
        ops.all_gather_copy_in([torch.ones(2), torch.ones(3, 2).t()], [2, 6], torch.empty(8))
    with raises(f"{AG_OUT}: argument 'all_gather_output' must be contiguous, got a tensor with sizes [8] and strides [2]"):
        ops.all_gather_copy_out(torch.empty(16)[::2], [4], 2, [torch.empty(8)])
    with raises(f"{AG_OUT}: argument 'outs[0]' must be contiguous, got a tensor with sizes [4, 2] and strides [1, 4]"):
        ops.all_gather_copy_out(torch.empty(8), [4], 2, [torch.empty(2, 4).t()])
    with raises(f"{RS_IN}: argument 'out' must be contiguous, got a tensor with sizes [8] and strides [2]"):
        ops.reduce_scatter_copy_in([torch.ones(8)], [4], 2, torch.empty(16)[::2])
    with raises(f"{RS_OUT}: argument 'grads[0]' must be contiguous, got a tensor with sizes [2, 2] and strides [1, 2]"):
        ops.reduce_scatter_copy_out(torch.empty(4), [4], [torch.empty(2, 2).t()])


def test_mismatched_devices():
    meta = torch.empty(4, device="meta")
    exp = "is on device meta, expected cpu (the device of the flat buffer)"
    with raises(f"{AG_IN}: argument 'shards[1]' {exp}"):
        ops.all_gather_copy_in([torch.ones(4), meta], [4, 4], torch.empty(8))
    with raises(f"{AG_IN}: argument 'shards[0]' is on device cpu, expected meta (the device of the flat buffer)"):
        ops.all_gather_copy_in([torch.ones(4)], [4], torch.empty(4, device="meta"))
    with raises(f"{AG_OUT}: argument 'outs[0]' {exp}"):
        ops.all_gather_copy_out(torch.empty(8), [4], 2, [torch.empty(8, device="meta")])
    with raises(f"{RS_IN}: argument 'grads[0]' {exp}"):
        ops.reduce_scatter_copy_in([torch.empty(8, device="meta")], [4], 2, torch.empty(8))
    with raises(f"{RS_OUT}: argument 'grads[0]' {exp}"):
        ops.reduce_scatter_copy_out(torch.empty(4), [4], [meta], divide_factor=2.0)


_CAST_TEXT = "expected equal dtypes, or a cast among torch.float32, torch.bfloat16, torch.float16 (view other dtypes as torch.uint8 to pack them together)"


def test_bad_dtype_pair():
    cast = _CAST_TEXT
    with raises(f"{AG_IN}: unsupported dtype pair for 'shards[0]': torch.int32 -> torch.float32; {cast}"):
        ops.all_gather_copy_in([torch.ones(4, dtype=torch.int32)], [4], torch.empty(4))
    with raises(f"{AG_IN}: unsupported dtype pair for 'shards[1]': torch.float32 -> torch.uint8; {cast}"):
        ops.all_gather_copy_in([torch.ones(4, dtype=torch.uint8), torch.ones(4)], [4, 4], torch.empty(8, dtype=torch.uint8))
    with raises(f"{AG_OUT}: unsupported dtype pair for 'outs[0]': torch.bfloat16 -> torch.int16; {cast}"):
        ops.all_gather_copy_out(torch.empty(8, dtype=bf16), [4], 2, [torch.empty(8, dtype=torch.int16)])
    with raises(f"{RS_IN}: unsupported dtype pair for 'grads[0]': torch.uint8 -> torch.int8; {cast}"):
        ops.reduce_scatter_copy_in([torch.ones(8, dtype=torch.uint8)], [4], 2, torch.empty(8, dtype=torch.int8))
    arith = "divide_factor != 1 or accumulate=True expects floating dtypes among torch.float32, torch.bfloat16, torch.float16"
    with raises(f"{RS_OUT}: unsupported dtype pair for 'grads[0]': torch.uint8 -> torch.uint8; {arith}"):
        ops.reduce_scatter_copy_out(torch.empty(4, dtype=torch.uint8), [4], [torch.empty(4, dtype=torch.uint8)], divide_factor=2.0)
    with raises(f"{RS_OUT}: unsupported dtype pair for 'grads[0]': torch.int32 -> torch.int32; {arith}"):
        ops.reduce_scatter_copy_out(torch.empty(4, dtype=torch.int32), [4], [torch.empty(4, dtype=torch.int32)], accumulate=True)
    # Same non-float dtype without arithmetic is a plain copy: allowed.
    ops.reduce_scatter_copy_out(torch.ones(4, dtype=torch.int32), [4], [torch.empty(4, dtype=torch.int32)])
    # The native op refuses other floating dtypes; the wrappers pack them with torch copies
    # (test_other_float_dtypes).
    with raises(f"{RS_OUT}: unsupported dtype pair for 'grads[0]': torch.float64 -> torch.float64; {arith}"):
        torch.ops.fsdp_native.reduce_scatter_copy_out(torch.empty(4, dtype=torch.float64), [4], 1.0, True, [torch.empty(4, dtype=torch.float64)])


# float64 parameters under a bf16 or fp32 policy, float8 ones: what torch FSDP2 casts with
# torch copies, the ops do too, as the native kernels would (float64 arithmetic where a side is
# float64). Compared with the references bit for bit (values without NaNs: their payloads
# through float64 arithmetic are not the point).
OTHER_PAIRS = [(torch.float64, f32), (torch.float64, bf16), (f32, torch.float64), (bf16, torch.float64),
               (torch.float64, torch.float64), (torch.float8_e4m3fn, bf16), (f32, torch.float8_e4m3fn)]


def _other_values(shape, dtype, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 4
    return x.to(dtype)


@pytest.mark.parametrize("pair", OTHER_PAIRS, ids=pair_id)
def test_other_float_dtypes(pair):
    src, dst = pair
    world_size = 3
    gen = torch.Generator().manual_seed(5)
    padded = padded_of(EDGE_SHAPES, world_size)
    params = [_other_values(s, src, gen) for s in EDGE_SHAPES]
    # all-gather copy-in on every rank, then copy-out: the parameters, cast
    ag = torch.empty(world_size * sum(padded), dtype=dst)
    for rank in range(world_size):
        shards = [shard_of(p, world_size, rank) for p in params]
        out = ag.narrow(0, rank * sum(padded), sum(padded)).fill_(7)
        ops.all_gather_copy_in(shards, padded, out)
        assert_bitwise(out, ref_copy_in(shards, padded, dst))
    outs = [torch.full(s, 7, dtype=src) for s in EDGE_SHAPES]
    ops.all_gather_copy_out(ag, padded, world_size, outs)
    for o, r in zip(outs, ref_copy_out(ag, padded, world_size, outs)):
        assert_bitwise(o, r)
    # reduce-scatter copy-in
    rs = torch.full((world_size * sum(padded),), 7, dtype=dst)
    ops.reduce_scatter_copy_in(params, padded, world_size, rs)
    assert_bitwise(rs, ref_rs_copy_in(params, padded, world_size, dst))
    # reduce-scatter copy-out of dst (the reduce dtype) into src gradients: copy, divide, accumulate
    shapes = [shard_of(torch.empty(s), world_size, 0).shape for s in EDGE_SHAPES]
    shard = _other_values((sum(padded),), dst, gen)
    opmath = torch.float64 if torch.float64 in pair else f32
    for divide_factor, accumulate in [(1.0, False), (4.0, False), (1.0, True), (3.0, True)]:
        grads = [_other_values(s, src, gen) for s in shapes]
        before = [g.clone() for g in grads]
        ops.reduce_scatter_copy_out(shard, padded, grads, divide_factor=divide_factor, accumulate=accumulate)
        off = 0
        for g, b, p in zip(grads, before, padded):
            v = shard[off : off + g.numel()].reshape(g.shape).to(opmath)
            if divide_factor != 1.0:
                v = v * torch.tensor(1.0 / divide_factor, dtype=opmath)
            assert_bitwise(g, (b.to(opmath) + v if accumulate else v).to(src))
            off += p


def test_other_float_dtypes_errors_stay():
    """The torch fallback is for floating dtypes only: a bad size or a non-float side still
    fails with the native op's message, and writes nothing."""
    f64 = torch.float64
    with raises(f"{AG_IN}: argument 'shards[0]' has 5 elements, expected at most padded_numels[0] = 4"):
        ops.all_gather_copy_in([torch.ones(5, dtype=f64)], [4], torch.empty(4))
    out = torch.full((8,), 7, dtype=torch.int32)
    with raises(f"{RS_IN}: unsupported dtype pair for 'grads[0]': torch.float64 -> torch.int32; {_CAST_TEXT}"):
        ops.reduce_scatter_copy_in([torch.ones(8, dtype=f64)], [4], 2, out)
    assert torch.equal(out, torch.full((8,), 7, dtype=torch.int32))
    grads = [torch.full((4,), 7.0, dtype=f64)]
    for factor, shown in [(0.0, "0"), (-0.5, "-0.5"), (float("nan"), "nan")]:
        with raises(f"{RS_OUT}: argument 'divide_factor' is {shown}, expected a positive number"):
            ops.reduce_scatter_copy_out(torch.ones(4, dtype=bf16), [4], grads, divide_factor=factor, accumulate=True)
    with raises(f"{RS_OUT}: argument 'grads[0]' has 4 elements, expected at most padded_numels[0] = 3"):
        ops.reduce_scatter_copy_out(torch.ones(3, dtype=bf16), [3], grads, accumulate=True)
    with raises(f"{AG_OUT}: argument 'outs[0]' must be contiguous, got a tensor with sizes [2, 4] and strides [1, 2]"):
        ops.all_gather_copy_out(torch.empty(8), [4], 2, [torch.empty(4, 2, dtype=f64).t()])
    assert torch.equal(grads[0], torch.full((4,), 7.0, dtype=f64))


def test_sizes_not_dividing_as_declared():
    with raises(f"{AG_IN}: argument 'shards[0]' has 5 elements, expected at most padded_numels[0] = 4"):
        ops.all_gather_copy_in([torch.ones(5)], [4], torch.empty(4))
    with raises(f"{AG_OUT}: argument 'outs[1]' has 7 elements, expected at most world_size x padded_numels[1] = 6"):
        ops.all_gather_copy_out(torch.empty(16), [5, 3], 2, [torch.empty(10), torch.empty(7)])
    with raises(f"{RS_IN}: argument 'grads[0]' has 11 elements, expected at most world_size x padded_numels[0] = 10"):
        ops.reduce_scatter_copy_in([torch.ones(11), torch.ones(6)], [5, 3], 2, torch.empty(16))
    with raises(f"{RS_OUT}: argument 'grads[1]' has 4 elements, expected at most padded_numels[1] = 3"):
        ops.reduce_scatter_copy_out(torch.empty(8), [5, 3], [torch.empty(5), torch.empty(4)])
    # An all-gather output that does not divide by world_size.
    with raises(f"{AG_OUT}: argument 'all_gather_output' has 10 elements, expected 12 (world_size 3 x sum of padded_numels 4)"):
        ops.all_gather_copy_out(torch.empty(10), [4], 3, [torch.empty(10)])


def test_wrong_padded_numels_length():
    with raises(f"{AG_IN}: argument 'padded_numels' has 1 entries, expected 2 (one per tensor of 'shards')"):
        ops.all_gather_copy_in([torch.ones(2), torch.ones(2)], [4], torch.empty(4))
    with raises(f"{AG_OUT}: argument 'padded_numels' has 3 entries, expected 2 (one per tensor of 'outs')"):
        ops.all_gather_copy_out(torch.empty(12), [2, 2, 2], 2, [torch.empty(4), torch.empty(4)])
    with raises(f"{RS_IN}: argument 'padded_numels' has 0 entries, expected 1 (one per tensor of 'grads')"):
        ops.reduce_scatter_copy_in([torch.ones(2)], [], 2, torch.empty(0))
    with raises(f"{RS_OUT}: argument 'padded_numels' has 2 entries, expected 1 (one per tensor of 'grads')"):
        ops.reduce_scatter_copy_out(torch.empty(4), [2, 2], [torch.empty(2)])
    with raises(f"{AG_IN}: argument 'padded_numels[1]' is -3, expected a non-negative element count"):
        ops.all_gather_copy_in([torch.ones(2), torch.ones(0)], [5, -3], torch.empty(2))


@pytest.mark.parametrize("world_size", [0, -1, -8])
def test_bad_world_size(world_size):
    with raises(f"{AG_OUT}: argument 'world_size' is {world_size}, expected a positive integer"):
        ops.all_gather_copy_out(torch.empty(4), [4], world_size, [torch.empty(4)])
    with raises(f"{RS_IN}: argument 'world_size' is {world_size}, expected a positive integer"):
        ops.reduce_scatter_copy_in([torch.ones(4)], [4], world_size, torch.empty(4))


@pytest.mark.parametrize("divide_factor,shown", [(0.0, "0"), (-2.0, "-2"), (-0.5, "-0.5"), (float("nan"), "nan")])
def test_bad_divide_factor(divide_factor, shown):
    with raises(f"{RS_OUT}: argument 'divide_factor' is {shown}, expected a positive number"):
        ops.reduce_scatter_copy_out(torch.empty(4), [4], [torch.empty(4)], divide_factor=divide_factor)


def test_errors_leave_outputs_untouched():
    out = torch.full((4,), 7.0)
    with pytest.raises(RuntimeError):
        ops.all_gather_copy_in([torch.ones(2), torch.ones(5)], [2, 2], out)
    assert torch.equal(out, torch.full((4,), 7.0))
