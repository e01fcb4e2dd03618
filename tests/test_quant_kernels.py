"""Kernels of the quantized all-gather formats (fsdp_native.quant), on CPU.

* the C++ kernels equal the plain-torch reference (fsdp_native._quant_ref) bit for bit on the
  encoded bytes and the dequantized values: a grid of formats x source / output dtypes x world
  sizes x awkward shapes (zero-size, one element, 0-dim, dim 0 below the world size, rows
  longer than NF4 blocks), values with NaN, infinities, subnormals, all zeros;
* the e4m3 rounding on every bfloat16 value and on the e4m3 rounding ties, every code's
  decoding, NF4 ties at the midpoints;
* hypothesis round trips: quantize on every simulated rank, concatenate (the all-gather),
  dequantize; bitwise against the reference, and within each format's error bound;
* the global-amax variant, the [world_size, chunk] view of a larger buffer, garbage bytes;
* exact error messages (C++ and the Python checks of the fakes and the Triton path) and
  torch.library.opcheck;
* the Triton kernels equal the C++ ones bit for bit, run with TRITON_INTERPRET=1 in a
  subprocess (``python tests/test_quant_kernels.py --triton`` runs that part alone), and
  compiled for the GPU where there is one (``test_triton_matches_cpp_on_cuda``);
* every level of CPU kernels this machine has (FSDP_NATIVE_QUANT_ISA=avx512 and portable
  below the default best), the bit-exact tests again in a subprocess each.
"""
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_native import _quant_ref as R
from fsdp_native import quant as Q
from fsdp_native.ops import padded_shard_numel

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (f32, bf16, f16)
EDGE_SHAPES = [(), (1,), (0,), (0, 4), (4, 0), (3, 5), (7,), (2, 3, 4), (13, 1), (9, 2), (5, 130)]
_BITS = {f32: torch.int32, bf16: torch.int16, f16: torch.int16}


def row_numel(shape) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def make_values(shape, dtype, gen, special=False, scale=3.0):
    x = torch.randn(shape, generator=gen) * scale
    if special and x.numel() >= 8:
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[:6]
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -0.0, 0.0])
    return x.to(dtype)


def shards_of(full: torch.Tensor, padded: int, rank: int) -> torch.Tensor:
    flat = full.reshape(-1)
    lo = min(rank * padded, flat.numel())
    return flat[lo : min(lo + padded, flat.numel())].contiguous()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS.get(a.dtype, a.dtype)), b.view(_BITS.get(b.dtype, b.dtype)))


def run_unit(fulls, ws, fmt, out_dtype, block_size=64, quantize=None, dequantize=None):
    """Quantize every rank's shards (C++ unless given), compare each chunk with the reference,
    all-gather by concatenation, dequantize, compare with the reference. Returns the outs."""
    quantize = quantize or torch.ops.fsdp_native.quantize_copy_in
    dequantize = dequantize or torch.ops.fsdp_native.dequantize_copy_out
    padded = [padded_shard_numel(f.shape, ws) for f in fulls]
    rows = [row_numel(f.shape) for f in fulls]
    layout = Q.unit_layout(padded, rows, fmt, block_size=block_size)
    chunks = []
    for r in range(ws):
        shards = [shards_of(f, p, r) for f, p in zip(fulls, padded)]
        out = torch.full((layout.rank_nbytes,), 0xA5, dtype=torch.uint8)  # garbage: every byte must be written
        quantize(shards, padded, rows, fmt, block_size, None, out)
        ref = R.quantize(shards, padded, rows, fmt, block_size)
        assert torch.equal(out, ref), f"rank {r}: bytes differ at {(out != ref).nonzero().view(-1)[:8].tolist()}"
        chunks.append(out)
    gathered = torch.cat(chunks)
    outs = [torch.full((f.numel(),), 7.0, dtype=out_dtype) for f in fulls]
    dequantize(gathered, padded, rows, ws, fmt, block_size, outs)
    refs = R.dequantize(gathered, padded, rows, ws, fmt, [f.numel() for f in fulls], [out_dtype] * len(fulls), block_size)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert same_bits(o, ref), f"outs[{i}] differs from the reference"
    return outs


# ----------------------------------------------------------------------------- layout


def test_layout():
    assert Q.encoded_nbytes(0, 7, "fp8_rowwise") == 0
    assert Q.segment_layout(10, 5, "fp8_rowwise") == Q.Segment(0, 10, 12, 2, 32)
    assert Q.segment_layout(10, 5, "fp8_tensorwise") == Q.Segment(0, 10, 12, 1, 16)
    assert Q.segment_layout(129, 1, "nf4") == Q.Segment(0, 65, 68, 3, 80)
    assert Q.segment_layout(129, 1, "nf4", block_size=256) == Q.Segment(0, 65, 68, 1, 80)
    lay = Q.unit_layout([10, 0, 129], [5, 3, 1], "nf4")
    assert [s.offset for s in lay.segments] == [0, 16, 16] and lay.rank_nbytes == 96


def test_bytes_against_bf16():
    """The issue's byte targets on a Llama-3-8B layer sharded over 8 ranks: fp8 at most 0.52x
    the bf16 bytes (scales included), NF4 at most 0.30x."""
    shapes = [(4096,), (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,), (14336, 4096), (14336, 4096), (4096, 14336)]
    padded = [padded_shard_numel(s, 8) for s in shapes]
    rows = [row_numel(s) for s in shapes]
    bf16_bytes = 2 * sum(padded)
    for fmt, bound in (("fp8_tensorwise", 0.52), ("fp8_rowwise", 0.52), ("nf4", 0.30)):
        assert Q.unit_layout(padded, rows, fmt).rank_nbytes / bf16_bytes <= bound
    assert abs(Q.unit_layout(padded, rows, "nf4").rank_nbytes / bf16_bytes - 0.28125) < 1e-3


# ----------------------------------------------------------------------------- bitwise grid


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_grid_matches_reference(fmt, src):
    gen = torch.Generator().manual_seed(hash((fmt, str(src))) % 2**31)
    for ws in (1, 2, 3, 8):
        fulls = [make_values(s, src, gen, special=True) for s in EDGE_SHAPES]
        for out_dtype in FLOATS:
            run_unit(fulls, ws, fmt, out_dtype)
    # all zeros, a single element, rows longer than NF4 blocks, another block size
    run_unit([torch.zeros(6, 100, dtype=src)], 2, fmt, f32)
    run_unit([make_values((1,), src, gen)], 4, fmt, bf16)
    run_unit([make_values((3, 300), src, gen, special=True)], 2, fmt, f32, block_size=256)
    run_unit([make_values((3, 300), src, gen)], 2, fmt, f32, block_size=2)


def test_large_unit_multithreaded():
    """Several tasks per parameter (rows, blocks and chunks spread over threads)."""
    gen = torch.Generator().manual_seed(1)
    fulls = [make_values((300, 1000), bf16, gen, special=True), make_values((77777,), f32, gen)]
    for fmt in Q.FORMATS:
        run_unit(fulls, 2, fmt, bf16)


# ----------------------------------------------------------------------------- element rules


def _quantize_one(x: torch.Tensor, fmt: str, amax=None, block_size=64) -> torch.Tensor:
    padded = x.numel()
    rows = x.numel() if fmt == "fp8_rowwise" else 1
    out = torch.empty(Q.unit_layout([padded], [rows], fmt, block_size=block_size).rank_nbytes, dtype=torch.uint8)
    torch.ops.fsdp_native.quantize_copy_in([x], [padded], [rows], fmt, block_size, amax, out)
    assert torch.equal(out, R.quantize([x], [padded], [rows], fmt, block_size, amax))
    return out


def test_e4m3_rounding_every_bf16_value_and_ties():
    """With amax 448 the scale is 1: the codes are e4m3fn(clamp(x)), which must equal torch's
    own cast (nearest even, subnormals) for every bfloat16 value and at every tie."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(bf16).float()
    x = x[torch.isfinite(x)]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2  # ties, exact in fp32
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))])
    x = torch.cat([x, near, torch.tensor([448.0, 464.0, -500.0, 2.0**-10, 2.0**-10 * 3, 2.0**-9 * 0.5])])
    out = _quantize_one(x, "fp8_tensorwise", amax=torch.tensor([448.0]))
    so = Q.segment_layout(x.numel(), 1, "fp8_tensorwise").scale_offset
    assert out[so : so + 4].view(f32).item() == 1.0
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out[: x.numel()], expected)


def test_e4m3_decoding_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    seg = Q.segment_layout(256, 1, "fp8_tensorwise")
    buf = torch.zeros(seg.nbytes, dtype=torch.uint8)
    buf[:256] = codes
    buf[seg.scale_offset : seg.scale_offset + 4] = torch.tensor([1.0]).view(torch.uint8)
    out = torch.empty(256)
    torch.ops.fsdp_native.dequantize_copy_out(buf, [256], [1], 1, "fp8_tensorwise", 64, [out])
    expected = codes.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expected)
    assert nan.sum() == 2 and torch.isnan(out[nan]).all() and torch.equal(out[~nan], expected[~nan])
    assert (out[nan].view(torch.int32) == 0x7FC00000).all()


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fp8_decode_every_code_long_runs(fmt, out_dtype):
    """Every code, 8 times over (rows of 2048: long enough for the vector decodes of every
    level), at scales whose products are subnormal, overflow or are ordinary, against the
    reference. 2^100 is the largest scale of the fp16-widening decodes (AVX-512, AVX2: 256 scale
    exact), 2^-149 the smallest subnormal one; larger scales take the AVX2 level's table."""
    n, row = 2048, 2048
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(n // 256)
    codes = codes[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    for scale in (1.0, 3.0e-3, 2.0**-133, 2.0**-149, -0.75, 2.0**100, 1.7e36, 2.0**120, float("nan")):
        seg = Q.segment_layout(n, row, fmt)
        buf = torch.zeros(seg.nbytes, dtype=torch.uint8)
        buf[:n] = codes
        buf[seg.scale_offset : seg.scale_offset + 4] = torch.tensor([scale]).view(torch.uint8)
        out = torch.empty(n, dtype=out_dtype)
        torch.ops.fsdp_native.dequantize_copy_out(buf, [n], [row], 1, fmt, 64, [out])
        want = R.dequantize(buf, [n], [row], 1, fmt, [n], [out_dtype])[0]
        bits = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert torch.equal(out.view(bits), want.view(bits)), (fmt, out_dtype, scale)


def test_nf4_ties_and_codes():
    """Block max 1 -> scale 1: each midpoint takes the lower code, just above it the upper."""
    mids = torch.tensor(R.NF4_MIDPOINTS)
    values = torch.tensor(R.NF4_VALUES)
    x = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), values, torch.tensor([1.0])])
    x = torch.cat([x, torch.zeros(64 - x.numel())])
    out = _quantize_one(x, "nf4")
    codes = torch.stack([out[:32] >> 4, out[:32] & 15], 1).view(-1)[: x.numel()].long()
    assert codes[:15].tolist() == list(range(15))
    assert codes[15:30].tolist() == list(range(1, 16))
    assert codes[30:46].tolist() == list(range(16))


def test_non_finite_and_zero_rules():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.0, 0.0, -0.0, 0.5])
    for fmt in ("fp8_tensorwise", "fp8_rowwise"):
        out = _quantize_one(x, fmt)
        assert out[1:4].tolist() == [0x7F] * 3 and out[6].item() == 0x80
        assert out[8:12].view(f32).item() == (torch.tensor(2.0) / 448).item()  # amax over the finite values only
        y = torch.empty(8)
        torch.ops.fsdp_native.dequantize_copy_out(out, [8], [8 if fmt == "fp8_rowwise" else 1], 1, fmt, 64, [y])
        assert torch.isnan(y[1:4]).all() and torch.equal(y[[0, 4, 5, 7]], x[[0, 4, 5, 7]])
        assert y[6].item() == 0 and math.copysign(1, y[6].item()) == -1
    # NF4: the block with a NaN or an inf dequantizes to NaN; the others are untouched
    z = torch.cat([torch.ones(64), x, torch.zeros(56)])
    out = _quantize_one(z, "nf4")
    s = out[64:72].view(f32)
    assert s[0].item() == 1.0 and torch.isnan(s[1]) and s[1].view(torch.int32).item() == 0x7FC00000
    y = torch.empty(128)
    torch.ops.fsdp_native.dequantize_copy_out(out, [128], [1], 1, "nf4", 64, [y])
    assert torch.equal(y[:64], torch.ones(64)) and torch.isnan(y[64:]).all()
    # all zeros: scale 1, zero codes
    for fmt in Q.FORMATS:
        out = _quantize_one(torch.zeros(64), fmt)
        seg = Q.segment_layout(64, 64 if fmt == "fp8_rowwise" else 1, fmt)
        assert (out[: seg.data_nbytes] == (0x77 if fmt == "nf4" else 0)).all()
        assert (out[seg.scale_offset : seg.scale_offset + 4 * seg.n_scales].view(f32) == 1).all()


@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_rowwise_finite_and_non_finite_rows_in_one_call(src):
    """fp8_rowwise picks per row: a row without inf or NaN takes the encode without the
    non-finite fix-up, a row with one the full encode. Rows long enough for the vector loops,
    each kind next to the other, with the non-finite value at the start, middle or end."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 320, generator=gen) * 5
    x[1, 0], x[3, 161], x[5, 319], x[6, 64] = float("nan"), float("inf"), -float("inf"), float("nan")
    x[6, 300] = float("inf")
    x = x.to(src)
    padded, rows = x.numel(), 320
    out = torch.empty(Q.unit_layout([padded], [rows], "fp8_rowwise").rank_nbytes, dtype=torch.uint8)
    torch.ops.fsdp_native.quantize_copy_in([x.reshape(-1)], [padded], [rows], "fp8_rowwise", 64, None, out)
    assert torch.equal(out, R.quantize([x.reshape(-1)], [padded], [rows], "fp8_rowwise", 64, None))
    codes = out[:padded].view(8, 320)
    assert codes[1, 0].item() == 0x7F and codes[3, 161].item() == 0x7F and codes[5, 319].item() == 0x7F  # e4m3fn has no inf: both signs take the NaN code
    finite_rows = [0, 2, 4, 7]
    assert ((codes[finite_rows] & 0x7F) != 0x7F).all()  # no NaN code in a finite row


@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("row", [37, 64, 100, 320, 333, 1000])
def test_rowwise_amax_of_each_row_wherever_it_sits(src, row):
    """Each row's scale comes from its own amax, whose vector loops take whole vectors and then
    the rest of the row. Each row's largest |x| sits in a different place (first element,
    inside the vectors, the last whole 64, the part after it, the last element), and a row with
    an inf sits between finite ones."""
    gen = torch.Generator().manual_seed(row)
    n_rows = 9
    x = torch.rand(n_rows, row, generator=gen) - 0.5
    whole = row // 64 * 64
    places = [0, row // 2, max(whole - 1, 0), min(whole, row - 1), row - 1, row - 1, (row * 7) // 9, 1, row - 2]
    for r, j in enumerate(places):
        x[r, j] = (r + 2) * 1.5 * (-1) ** r
    x[5, row // 3] = float("inf")
    x = x.to(src)
    padded = x.numel()
    seg = Q.unit_layout([padded], [row], "fp8_rowwise").segments[0]
    out = torch.empty(seg.nbytes, dtype=torch.uint8)
    torch.ops.fsdp_native.quantize_copy_in([x.reshape(-1)], [padded], [row], "fp8_rowwise", 64, None, out)
    assert torch.equal(out, R.quantize([x.reshape(-1)], [padded], [row], "fp8_rowwise", 64, None))
    scales = out[seg.scale_offset : seg.scale_offset + 4 * n_rows].view(torch.float32)
    for r in (0, 1, 2, 3, 4, 6, 7, 8):  # each finite row's scale comes from its own amax
        amax = x[r].float().abs().max().item()
        assert scales[r].item() == pytest.approx(amax / 448, rel=2**-20), (r, places[r])


@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("block_size", [32, 64, 128, 256, 512])
def test_nf4_runs_of_blocks_with_special_blocks(src, block_size):
    """NF4 takes whole blocks 16 at a time with AVX-512 and 8 at a time with AVX2 (their
    amaxes, scales and inverse scales as vectors) where the run fits in the cache, one at a
    time otherwise and for the rest. Every block's amax is different and sits at a different
    position; blocks with a NaN, an inf, all zeros, a subnormal amax or the largest finite value
    are spread over the runs; the source starts at an odd element and ends in a partial block
    inside the padded range."""
    gen = torch.Generator().manual_seed(block_size)
    n_blocks = 37
    x = torch.rand(n_blocks, block_size, generator=gen) - 0.5  # below every block's amax
    for b in range(n_blocks):
        x[b, (b * 13) % block_size] = (b + 1) * 0.75 * (-1) ** b  # the block's amax, in its own place
    x[2, 5], x[17, block_size - 1], x[33, 0] = float("nan"), float("inf"), -float("inf")
    x[5], x[20] = 0.0, 0.0
    x[9] = x[9] * 1e-41  # subnormal amax (fp32; zeros in bf16 and fp16)
    x[15, 1] = torch.finfo(src).max
    flat = torch.cat([torch.zeros(1), x.reshape(-1)]).to(src)[1:]  # misaligned start
    n = flat.numel() - block_size // 2  # a partial last block, padded
    shard, padded = flat[:n], flat.numel()
    out = torch.full((Q.unit_layout([padded], [1], "nf4", block_size=block_size).rank_nbytes,), 0xA5, dtype=torch.uint8)
    torch.ops.fsdp_native.quantize_copy_in([shard], [padded], [1], "nf4", block_size, None, out)
    ref = R.quantize([shard], [padded], [1], "nf4", block_size, None)
    assert torch.equal(out, ref), f"bytes differ at {(out != ref).nonzero().view(-1)[:8].tolist()}"
    scales = out[padded // 2 :].view(f32)
    assert torch.isnan(scales[[2, 17, 33]]).all() and (scales[[5, 20]] == 1).all()
    assert scales[0].item() == 0.75 and scales[16].item() == 17 * 0.75  # the blocks' own amaxes, in order


def test_tiny_amax_scale_floor():
    """An amax below 448 * 2^-126 gives the scale 2^-126, so x / scale stays finite."""
    x = torch.tensor([1e-44, -3e-45, 0.0, 1e-42])
    out = _quantize_one(x, "fp8_tensorwise")
    assert out[4:8].view(f32).item() == 2.0**-126
    y = torch.empty(4)
    torch.ops.fsdp_native.dequantize_copy_out(out, [4], [1], 1, "fp8_tensorwise", 64, [y])
    assert torch.isfinite(y).all() and (y - x).abs().max() <= 2.0**-10 * 2.0**-126


# ----------------------------------------------------------------------------- error bounds


def check_error_bound(full, deq, fmt, ws, block_size=64):
    """fp8: |deq - x| <= 2^-4 |x| (e4m3 normals, relative to the scale-normalised value), or
    2^-10 scale below the e4m3 normals; NF4: half the largest gap between NF4 values (0.152)
    times the block scale (its absmax, at least 2^-126). Finite values; fp32 outputs (one
    more fp32 rounding of slack)."""
    x = full.reshape(-1).float()
    padded = padded_shard_numel(full.shape, ws)
    rows = row_numel(full.shape)
    finite = torch.isfinite(x)
    err = (deq.float() - x).abs()
    a = torch.where(finite, x.abs(), torch.zeros_like(x))
    if fmt == "nf4":
        half_gap = max(b - a_ for a_, b in zip(R.NF4_VALUES, R.NF4_VALUES[1:])) / 2
        n = x.numel()
        idx = torch.arange(n)
        blk = (idx // padded) * 10**9 + (idx % padded) // block_size  # block id within a rank
        _, inv = torch.unique(blk, return_inverse=True)
        absmax = torch.zeros(int(inv.max()) + 1 if n else 0).scatter_reduce(0, inv, a, "amax")
        bad = torch.zeros_like(absmax).scatter_reduce(0, inv, (~finite).float(), "amax")
        ok = bad[inv] == 0
        bound = half_gap * absmax.clamp(min=2.0**-126)[inv] * (1 + 2**-20)
    else:
        idx = torch.arange(x.numel())
        group = idx // rows if fmt == "fp8_rowwise" else idx // max(padded, 1)
        amax = torch.zeros(int(group.max()) + 1 if x.numel() else 0).scatter_reduce(0, group, a, "amax")
        scale = R.fp8_scale(amax)[group]
        ok = finite
        bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale) * (1 + 2**-20)
    assert (err[ok] <= bound[ok]).all(), f"{fmt}: error {err[ok].max()} above its bound"


shape_st = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=4),
    ws=st.integers(1, 5),
    fmt=st.sampled_from(Q.FORMATS),
    src=st.sampled_from(FLOATS),
    out_dtype=st.sampled_from(FLOATS),
    block_size=st.sampled_from([2, 8, 64]),
    special=st.booleans(),
    scale_exp=st.integers(-140, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_hypothesis(shapes, ws, fmt, src, out_dtype, block_size, special, scale_exp, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0**scale_exp if src == f32 else 2.0 ** max(scale_exp, -20)  # subnormals in fp32
    fulls = [make_values(s, src, gen, special=special, scale=scale) for s in shapes]
    outs = run_unit(fulls, ws, fmt, out_dtype, block_size)
    if out_dtype == f32:
        for full, deq in zip(fulls, outs):
            check_error_bound(full, deq, fmt, ws, block_size)


def test_error_bounds_typical_weights():
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(257, 96, generator=gen) * 0.02
    for fmt in Q.FORMATS:
        (deq,) = run_unit([full], 3, fmt, f32)
        check_error_bound(full, deq, fmt, 3)


# ----------------------------------------------------------------------------- variants


def test_global_amax_variant():
    gen = torch.Generator().manual_seed(4)
    fulls = [make_values((10, 7), bf16, gen, special=True), make_values((5,), f32, gen), torch.zeros(0)]
    ws = 2
    padded = [padded_shard_numel(f.shape, ws) for f in fulls]
    rows = [row_numel(f.shape) for f in fulls]
    per_rank = [[shards_of(f, p, r) for f, p in zip(fulls, padded)] for r in range(ws)]
    amaxes = []
    for shards in per_rank:
        a = torch.empty(len(shards))
        torch.ops.fsdp_native.quantize_amax(shards, a)
        assert torch.equal(a, torch.stack([R.finite_amax(s.float().reshape(-1)) for s in shards]))
        amaxes.append(a)
    global_amax = torch.stack(amaxes).amax(0)  # the all-reduce (MAX)
    lay = Q.unit_layout(padded, rows, "fp8_tensorwise")
    for shards in per_rank:
        out = torch.empty(lay.rank_nbytes, dtype=torch.uint8)
        Q.quantize_copy_in(shards, padded, rows, out, format="fp8_tensorwise", amax=global_amax)
        assert torch.equal(out, R.quantize(shards, padded, rows, "fp8_tensorwise", 64, global_amax))
        s = lay.segments[0]
        assert out[s.scale_offset : s.scale_offset + 4].view(f32).item() == R.fp8_scale(global_amax[:1]).item()
    # a stale (too small) amax saturates instead of overflowing; a bad one gives scale 1
    x = torch.tensor([1.0, -3.0, 2.0, 0.25])
    out = _quantize_one(x, "fp8_tensorwise", amax=torch.tensor([1.0]))
    assert out[:4].view(torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 448.0, 112.0]
    for bad in (float("nan"), float("inf"), -1.0):
        out = _quantize_one(x, "fp8_tensorwise", amax=torch.tensor([bad]))
        assert out[4:8].view(f32).item() == 1.0
    # x / scale overflowing to inf from a finite x saturates too (the vector kernels take such
    # runs of 32 to the loop, as they do an inf or NaN x), in whole runs and in the tail
    for src in (f32, bf16):
        x = torch.linspace(-2.0, 2.0, 100).to(src)
        x[[3, 40, 97]] = torch.tensor([3e38, -3e38, float("inf")]).to(src)
        out = _quantize_one(x, "fp8_tensorwise", amax=torch.tensor([1e-30]))  # also against the reference
        assert out[[3, 40, 97]].tolist() == [0x7E, 0xFE, 0x7F]


def test_gathered_as_rows_of_a_larger_buffer():
    """Quantized bytes first in each rank's chunk, other bytes after: a [world_size, n] view."""
    gen = torch.Generator().manual_seed(5)
    full = make_values((9, 20), bf16, gen)
    ws, extra = 3, 48
    padded, rows = [padded_shard_numel(full.shape, ws)], [20]
    for fmt in Q.FORMATS:
        n = Q.unit_layout(padded, rows, fmt).rank_nbytes
        buf = torch.full((ws, n + extra), 0xEE, dtype=torch.uint8)
        for r in range(ws):
            Q.quantize_copy_in([shards_of(full, padded[0], r)], padded, rows, buf[r, :n], format=fmt)
        a, b = torch.empty(full.numel(), dtype=bf16), torch.empty(full.numel(), dtype=bf16)
        Q.dequantize_copy_out(buf[:, :n], padded, rows, ws, [a], format=fmt)
        Q.dequantize_copy_out(buf[:, :n].contiguous().view(-1), padded, rows, ws, [b], format=fmt)
        assert same_bits(a, b) and (buf[:, n:] == 0xEE).all()


def test_garbage_bytes_do_not_crash():
    """Bytes no collective wrote (fake process group): any values, never a crash or a read or
    write out of bounds (every output element is written, nothing past it)."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(33, 7), (5,), (), (130,)]
    ws = 3
    padded = [padded_shard_numel(s, ws) for s in shapes]
    rows = [row_numel(s) for s in shapes]
    for fmt in Q.FORMATS:
        n = Q.unit_layout(padded, rows, fmt).rank_nbytes
        g = torch.randint(0, 256, (ws * n,), generator=gen, dtype=torch.int32).to(torch.uint8)
        g[::4] = 0xFF  # NaN fp32 scales, NaN e4m3 codes
        for dtype in FLOATS:
            outs = [torch.zeros(math.prod(s) + 8, dtype=dtype) for s in shapes]
            views = [o[: math.prod(s)] for o, s in zip(outs, shapes)]
            Q.dequantize_copy_out(g, padded, rows, ws, views, format=fmt)
            refs = R.dequantize(g, padded, rows, ws, fmt, [v.numel() for v in views], [dtype] * len(views))
            for o, v, ref in zip(outs, views, refs):
                assert same_bits(v, ref) and (o[v.numel() :] == 0).all()


# ----------------------------------------------------------------------------- errors

QI, DQ = "fsdp_native::quantize_copy_in", "fsdp_native::dequantize_copy_out"


def _qargs(**kw):
    a = dict(shards=[torch.ones(10), torch.ones(3, dtype=bf16)], padded_numels=[10, 4], row_numels=[5, 1],
             format="fp8_rowwise", block_size=64, amax=None)  # fmt: skip
    a.update(kw)
    a.setdefault("out", torch.empty(64, dtype=torch.uint8))  # [10] in rows of 5: 32 bytes; [4]: 32
    return a


QUANTIZE_ERRORS = [
    (dict(shards=[torch.ones(10, dtype=torch.int32), torch.ones(3)]),
     f"{QI}: argument 'shards[0]' has dtype torch.int32, expected torch.float32, torch.bfloat16 or torch.float16"),
    (dict(shards=[torch.ones(11), torch.ones(3)]), f"{QI}: argument 'shards[0]' has 11 elements, expected at most padded_numels[0] = 10"),
    (dict(out=torch.empty(40, dtype=torch.uint8)),
     f"{QI}: argument 'out' has 40 bytes, expected 64 (one rank's encoded chunk of the unit, fsdp_native.quant.unit_layout(...).rank_nbytes)"),
    (dict(out=torch.empty(64, dtype=torch.int8)), f"{QI}: argument 'out' has dtype torch.int8, expected torch.uint8"),
    (dict(format="fp4"), f"{QI}: argument 'format' is 'fp4', expected one of 'fp8_tensorwise', 'fp8_rowwise', 'nf4'"),
    (dict(format="nf4", block_size=48), f"{QI}: argument 'block_size' is 48, expected a power of two from 2 to 4096"),
    (dict(padded_numels=[10]), f"{QI}: argument 'padded_numels' has 1 entries, expected 2 (one per tensor of 'shards')"),
    (dict(row_numels=[5, 1, 1]), f"{QI}: argument 'row_numels' has 3 entries, expected 2 (one per tensor of 'shards')"),
    (dict(row_numels=[3, 1]),
     f"{QI}: argument 'padded_numels[0]' is 10, expected a multiple of row_numels[0] = 3 (fp8_rowwise has one scale per whole row)"),
    (dict(shards=[torch.ones(20)[::2], torch.ones(3)]),
     f"{QI}: argument 'shards[0]' must be contiguous, got a tensor with sizes [10] and strides [2]"),
    (dict(amax=torch.ones(2)), f"{QI}: argument 'amax' is a tensor, expected None for format 'fp8_rowwise' (only fp8_tensorwise takes a given amax)"),
]  # fmt: skip


@pytest.mark.parametrize("kw,msg", QUANTIZE_ERRORS, ids=range(len(QUANTIZE_ERRORS)))
def test_quantize_errors(kw, msg):
    a = _qargs(**kw)
    with pytest.raises(RuntimeError) as e:
        torch.ops.fsdp_native.quantize_copy_in(*a.values())
    assert str(e.value).split("\n")[0] == msg
    with pytest.raises(RuntimeError) as e:  # the fake / Triton checks word it the same way
        Q.check_quantize_args(*a.values())
    assert str(e.value) == msg


def test_quantize_amax_argument_errors():
    shards = [torch.ones(4)]
    a = dict(shards=shards, padded_numels=[4], row_numels=[1], format="fp8_tensorwise", block_size=64,
             amax=torch.ones(2), out=torch.empty(16, dtype=torch.uint8))  # fmt: skip
    msg = f"{QI}: argument 'amax' has 2 elements, expected 1 (one per tensor of 'shards')"
    with pytest.raises(RuntimeError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        torch.ops.fsdp_native.quantize_copy_in(*a.values())
    a["amax"] = torch.ones(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="argument 'amax' has dtype torch.float64, expected torch.float32"):
        torch.ops.fsdp_native.quantize_copy_in(*a.values())
    with pytest.raises(RuntimeError, match="fsdp_native::quantize_amax: argument 'out' has 2 elements, expected 1"):
        torch.ops.fsdp_native.quantize_amax(shards, torch.empty(2))


def _dargs(**kw):
    a = dict(gathered=torch.zeros(128, dtype=torch.uint8), padded_numels=[10, 4], row_numels=[5, 1], world_size=2,
             format="fp8_rowwise", block_size=64, outs=[torch.empty(20), torch.empty(7, dtype=bf16)])  # fmt: skip
    a.update(kw)
    return a


DEQUANTIZE_ERRORS = [
    (dict(outs=[torch.empty(20, dtype=torch.float64), torch.empty(7)]),
     f"{DQ}: argument 'outs[0]' has dtype torch.float64, expected torch.float32, torch.bfloat16 or torch.float16"),
    (dict(outs=[torch.empty(21), torch.empty(7)]), f"{DQ}: argument 'outs[0]' has 21 elements, expected at most world_size x padded_numels[0] = 20"),
    (dict(gathered=torch.zeros(127, dtype=torch.uint8)),
     f"{DQ}: argument 'gathered' has sizes [127], expected a contiguous [128] (world_size 2 x the encoded chunk of 64 bytes) "
     "or a [world_size, 64] view with unit inner stride"),
    (dict(gathered=torch.zeros(128, dtype=torch.float32)), f"{DQ}: argument 'gathered' has dtype torch.float32, expected torch.uint8"),
    (dict(gathered=torch.zeros(2, 80, dtype=torch.uint8)[:, :63]),
     f"{DQ}: argument 'gathered' has sizes [2, 63] and strides [80, 1], expected sizes [2, 64] with strides [a multiple of 4 of at least 64, 1]"),
    (dict(world_size=0), f"{DQ}: argument 'world_size' is 0, expected a positive integer"),
    (dict(format="nf4", block_size=0), f"{DQ}: argument 'block_size' is 0, expected a power of two from 2 to 4096"),
    (dict(padded_numels=[10, -4]), f"{DQ}: argument 'padded_numels[1]' is -4, expected a non-negative element count"),
]  # fmt: skip


@pytest.mark.parametrize("kw,msg", DEQUANTIZE_ERRORS, ids=range(len(DEQUANTIZE_ERRORS)))
def test_dequantize_errors(kw, msg):
    a = _dargs(**kw)
    with pytest.raises(RuntimeError) as e:
        torch.ops.fsdp_native.dequantize_copy_out(*a.values())
    assert str(e.value).split("\n")[0] == msg
    with pytest.raises(RuntimeError) as e:
        Q.check_dequantize_args(*a.values())
    assert str(e.value) == msg


def test_misaligned_buffer():
    raw = torch.empty(49, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="argument 'out' starts at an address that is not a multiple of 4"):
        torch.ops.fsdp_native.quantize_copy_in([torch.ones(10)], [10], [5], "fp8_rowwise", 64, None, raw[1:33])


# ----------------------------------------------------------------------------- opcheck


def test_opcheck():
    gen = torch.Generator().manual_seed(7)
    x, y = make_values((6, 10), bf16, gen), make_values((5,), f32, gen)
    for fmt in Q.FORMATS:
        padded, rows = [30, 3], [10, 1]
        shards = [x.view(-1)[:30].clone(), y[:3].clone()]
        n = Q.unit_layout(padded, rows, fmt).rank_nbytes
        out = torch.empty(n, dtype=torch.uint8)
        torch.library.opcheck(torch.ops.fsdp_native.quantize_copy_in.default, (shards, padded, rows, fmt, 64, None, out))
        g = torch.cat([out, out])
        outs = [torch.empty(60), torch.empty(5, dtype=bf16)]
        torch.library.opcheck(torch.ops.fsdp_native.dequantize_copy_out.default, (g, padded, rows, 2, fmt, 64, outs))
    torch.library.opcheck(
        torch.ops.fsdp_native.quantize_copy_in.default,
        ([x.view(-1)], [60], [1], "fp8_tensorwise", 64, torch.ones(1), torch.empty(64, dtype=torch.uint8)),
    )
    torch.library.opcheck(torch.ops.fsdp_native.quantize_amax.default, ([x, y], torch.empty(2)))


# ----------------------------------------------------------------------------- Triton


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton_available(), reason="triton is not installed")
def test_triton_matches_cpp_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__, "--triton"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "triton: all equal" in r.stdout
    # the interpreter's shim (tests/triton_interpreter.py) took effect: without it this run
    # takes about 1.8x as long
    skipped = re.search(r"interpreter shim: (\d+) re-patches skipped", r.stdout)
    assert skipped and int(skipped.group(1)) > 1000, r.stdout[-1000:]


def triton_main() -> None:
    """Triton (TRITON_INTERPRET=1) against C++, bit for bit; small sizes: the interpreter runs
    each program in numpy."""
    import triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    triton_interpreter.install()
    triton_vs_cpp(torch.device("cpu"))
    triton_alignment_claims()
    triton_random_units()
    triton_nf4_dequantize_without_gather()
    triton_cvt_compare()
    print(f"interpreter shim: {triton_interpreter.skipped} re-patches skipped")
    print("triton: all equal")


_DIMS = st.sampled_from([1, 2, 3, 5, 8, 16, 64, 128, 130, 256, 1000, 1024, 2048])


@st.composite
def _units(draw):
    """A unit of 1-3 parameters of 0-3 dims (whole tiles, padding rows, short and long rows
    likely), at most 24K elements each and 256 rows."""
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        dims = draw(st.lists(_DIMS, min_size=0, max_size=3))
        while math.prod(dims) > 24 * 1024 or (dims and math.prod(dims) // max(row_numel(dims), 1) > 256):
            dims = dims[1:]
        shapes.append(tuple(dims))
    return shapes


def triton_random_units() -> None:
    """Random units, world sizes, formats, dtypes and alignments: the Triton ops bit for bit
    against the C++ ones (their index math: whole and masked tiles, rows, ranks)."""

    @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_units(), st.sampled_from([1, 2, 3, 8]), st.sampled_from(Q.FORMATS), st.sampled_from(FLOATS),
           st.sampled_from(FLOATS), st.booleans(), st.integers(0, 2**16))  # fmt: skip
    def check(shapes, ws, fmt, src, out_dtype, misaligned, seed):
        gen = torch.Generator().manual_seed(seed)
        _triton_round_trip(torch.device("cpu"), [make_values(sh, src, gen, special=True) for sh in shapes], ws, fmt,
                           (out_dtype,), misaligned)  # fmt: skip

    check()
    print("random units equal")


def triton_nf4_dequantize_without_gather() -> None:
    """The NF4 dequantize's other way to an element's value (kernels.quant.NF4_DEQ_GATHER: the
    gather up to Triton 3.8, a table load and multiply from 3.9), bit for bit against the C++
    kernel: the small shapes in every dtype, whole tiles and misaligned buffers in fp32 and bf16."""
    Q._import_triton_kernels()
    from fsdp_native.kernels import quant as K

    gen = torch.Generator().manual_seed(11)
    K.NF4_DEQ_GATHER = not K.NF4_DEQ_GATHER
    K._PLANS.clear()
    try:
        for shapes, dtypes, misaligned in (([(), (1,), (3, 5), (9, 2), (5, 130)], FLOATS, False),
                                           ([(24, 1024), (7, 1024)], (f32, bf16), False), ([(6, 2048 + 8)], (f32, bf16), True)):  # fmt: skip
            for src in dtypes:
                fulls = [make_values(sh, src, gen, special=True) for sh in shapes]
                _triton_round_trip(torch.device("cpu"), fulls, 3, Q.NF4, dtypes, misaligned, garbage=True)
    finally:
        K.NF4_DEQ_GATHER = not K.NF4_DEQ_GATHER
        K._PLANS.clear()
    print(f"NF4 dequantize with NF4_DEQ_GATHER={not K.NF4_DEQ_GATHER} equal")


def triton_cvt_compare() -> None:
    """The comparison that checks the GPU's conversion instructions against the integer math
    over every fp32 on a GPU (test_conversion_instructions_match_integer_math_on_cuda), run
    here on a few ranges: it finds a planted difference (count and first), and the integer
    math against itself differs nowhere. (The interpreter's own conversions round otherwise,
    which is why CPU tensors never take the instructions.)"""
    import _cvt_check as C

    assert C.compare(C.PLANTED, False, False, 4096, 4096 * 4, "cpu") == (2340, 4102)
    assert C.compare(C.PLANTED, False, False, 0, 4096, "cpu") == (586, 0)
    for what, start in ((C.ENCODE, 0x3A000000), (C.ENCODE, 0xC3E00000 - 2048), (C.ENCODE, 0x7F800000 - 2048),
                        (C.ENCODE_OVERFLOW, 0x3FFFF800), (C.BF16, 0x7F7FF000), (C.DECODE, 0)):
        assert C.compare(what, False, False, start, 4096, "cpu") == (0, None), (what, start)
    print("conversion comparison checked")


def triton_alignment_claims() -> None:
    """A launch tells the compiler that its accesses are 16-byte aligned (HINT) exactly when
    its pointers, strides and rows are: a false claim would make the GPU read and write the
    wrong bytes, which the interpreter (it ignores the claims) cannot show. So the launches
    are recorded (and run) and their claims checked."""
    from triton.runtime.interpreter import InterpretedFunction

    Q._import_triton_kernels()
    ns = torch.ops.fsdp_native
    seen: list[tuple[str, bool, bool | None]] = []
    scales_aligned: list[tuple[str, bool | None]] = []
    order: list[tuple[str, bool | None]] = []
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, kwargs["HINT"], kwargs.get("EXACT")))
        scales_aligned.append((self.fn.__name__, kwargs.get("SA")))
        order.append((self.fn.__name__, kwargs.get("REVERSE")))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    def claims(fn, *args):
        seen.clear()
        fn(*args)
        assert seen, "no launch"
        return {(name, hint, exact) for name, hint, exact in seen}

    InterpretedFunction.run = run
    try:
        gen = torch.Generator().manual_seed(3)
        # rowwise: rows of 1000 bf16 are whole runs of 16 bytes (but not a power of two: not
        # EXACT), rows of 1004 are not
        for rows_of in (1024, 1000, 1004):
            x = make_values((8 * rows_of,), bf16, gen)
            padded, rows = [x.numel()], [rows_of]
            for fmt in Q.FORMATS:
                n = Q.unit_layout(padded, rows, fmt).rank_nbytes
                hint = fmt != Q.FP8_ROWWISE or rows_of % 8 == 0
                for shard, out, want in ((x, torch.empty(n + 16, dtype=torch.uint8)[:n], hint),
                                         (_off(x, True), torch.empty(n, dtype=torch.uint8), False),
                                         (x, torch.empty(n + 16, dtype=torch.uint8)[8 : 8 + n], False)):  # fmt: skip
                    scales_aligned.clear()
                    got = claims(ns.quantize_copy_in_triton, [shard], padded, rows, fmt, 64, None, out)
                    assert {a for k, a in scales_aligned if k != "_amax_kernel"} == {True}, (fmt, scales_aligned)
                    # (the amax pass reads the shard only)
                    assert {h for k, h, _ in got if k != "_amax_kernel" or shard is not x} == {want}, (fmt, rows_of, got)
                    if fmt == Q.FP8_ROWWISE:
                        assert {e for _, _, e in got} == {rows_of == 1024}, (rows_of, got)
                g = torch.zeros(2, n + 16, dtype=torch.uint8)
                out = torch.empty(2 * x.numel(), dtype=bf16)
                for gathered, o, want in ((g[:, :n], out, hint), (g.view(-1)[: 2 * (n + 4)].view(2, n + 4)[:, :n], out, False),
                                          (g[:, :n], _off(out, True), False)):  # fmt: skip
                    got = claims(ns.dequantize_copy_out_triton, gathered, padded, rows, 2, fmt, 64, [o])
                    assert {h for _, h, _ in got} == {want}, (fmt, rows_of, got)
        # the codes after an amax pass take the tiles last first (what the pass read last is
        # still in a GPU's L2 cache); with a given amax, in order
        for fmt, am in ((Q.FP8_TENSORWISE, None), (Q.FP8_TENSORWISE, torch.ones(1)), (Q.FP8_ROWWISE, None)):
            n = Q.unit_layout(padded, [1] if fmt == Q.FP8_TENSORWISE else rows, fmt).rank_nbytes
            order.clear()
            claims(ns.quantize_copy_in_triton, [x], padded, [1] if fmt == Q.FP8_TENSORWISE else rows, fmt, 64, am,
                   torch.empty(n, dtype=torch.uint8))  # fmt: skip
            want = [("_amax_kernel", None), ("_fp8_quantize_kernel", True)] if am is None else [("_fp8_quantize_kernel", False)]
            assert order == (want if fmt == Q.FP8_TENSORWISE else [("_fp8_rows_kernel", None)]), (fmt, order)
        # scale tables not 4-byte aligned (a uint8 buffer one byte in): written and read byte by
        # byte, no 4-byte access (the GPU faults on a misaligned one)
        for fmt in Q.FORMATS:
            n = Q.unit_layout(padded, rows, fmt).rank_nbytes
            for out in (torch.empty(n + 16, dtype=torch.uint8)[1 : 1 + n], torch.empty(n + 16, dtype=torch.uint8)[4 : 4 + n]):
                scales_aligned.clear()
                claims(ns.quantize_copy_in_triton, [x], padded, rows, fmt, 64, None, out)
                want = out.data_ptr() % 4 == 0
                assert {a for k, a in scales_aligned if k != "_amax_kernel"} == {want}, (fmt, scales_aligned)
            g = torch.zeros(2 * (n + 4) + 1, dtype=torch.uint8)  # (the op asks for rank strides of 4 bytes)
            for gathered, want in ((g[1 : 1 + 2 * n].view(2, n), False), (g[: 2 * (n + 4)].view(2, n + 4)[:, :n], True)):
                scales_aligned.clear()
                claims(ns.dequantize_copy_out_triton, gathered, padded, rows, 2, fmt, 64, [torch.empty(2 * x.numel(), dtype=bf16)])
                assert {a for _, a in scales_aligned} == {want}, (fmt, scales_aligned)
    finally:
        InterpretedFunction.run = orig
    print("alignment claims checked")


def _ptxas_available() -> bool:
    if not _triton_available():
        return False
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _ptxas_available(), reason="needs triton with its bundled ptxas")
@pytest.mark.parametrize("arch", [90, 80])
def test_triton_kernels_compile_to_wide_accesses(tmp_path, arch):
    """Compiled for an H100 and an A100 (sm_90, sm_80; no GPU needed: benchmarks/triton_sass.py),
    every kernel of a Llama-3-8B layer's quantize and dequantize reads or writes whole tiles
    16 bytes per access, and spills no register. The alignment the launches claim only reaches the compiler through hints that
    are easy to lose (a hint on a function's argument, or on pointers the compiler merges with
    the masked path's, does nothing); without them every access is one element wide, 3-4x the
    instructions per element."""
    out = tmp_path / "sass.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "triton_sass.py"), "--work", "llama", "--json", str(out),
                        "--arch", str(arch)], cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {row["op"] for row in rows} >= {"quantize fp8_rowwise", "dequantize nf4", "quantize_amax"}, rows
    for row in rows:
        assert row["mem"].get("LDG.128", 0) + row["mem"].get("STG.128", 0) > 0, row
        # no register spills (a register cap, kernels.quant.AMAX_MAXNREG, could make some)
        assert not [k for k in row["mem"] if k.startswith(("LDL", "STL"))], row
    # The NF4 quantize's code in inline PTX (NF4_CODE_ASM, off by default until a GPU runs it,
    # the "nf4 code" tune group): ptxas takes it, and under the tune group's cap of 96 registers
    # it keeps its wide accesses and spills nothing (Triton 3.6; 3.9 spills 8 bytes).
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "triton_sass.py"), "--work", "llama", "--json", str(out),
                        "--arch", str(arch), "--set", "NF4_CODE_ASM=True", "--set", "NF4_MAXNREG=96", "--ops", "quantize nf4"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["regs"] <= 96 and row["mem"].get("LDG.128", 0) > 0, row
    import triton

    if triton.__version__.startswith("3.6"):
        assert not [k for k in row["mem"] if k.startswith(("LDL", "STL"))], row


@pytest.mark.skipif(not torch.cuda.is_available() or not _triton_available(), reason="needs a GPU and triton")
@pytest.mark.parametrize("cvt", [True, False], ids=["cvt", "integer_math"])
def test_triton_matches_cpp_on_cuda(cvt, monkeypatch):
    """The Triton kernels compiled for the GPU against the C++ kernels on CPU, bit for bit:
    the interpreted run's cases, plus shards big enough for many programs per parameter; with
    the GPU's conversion instructions where it has them (compute capability 8.9+), and with
    the integer math (FSDP_NATIVE_TRITON_CVT=0, and older GPUs)."""
    Q._import_triton_kernels()
    from fsdp_native.kernels import quant as K

    monkeypatch.setattr(K, "HW_CVT", cvt)
    assert K._cvt(torch.device("cuda")) == (cvt and torch.cuda.get_device_capability() >= (8, 9))
    triton_vs_cpp(torch.device("cuda"), big=True)


@pytest.mark.skipif(not torch.cuda.is_available() or not _triton_available(), reason="needs a GPU and triton")
def test_conversion_instructions_match_integer_math_on_cuda():
    """On a GPU with the conversion instructions (compute capability 8.9+: cvt to e4m3 and to
    bf16, e4m3 to fp16), they give the integer math's bits for every one of the 2^32 fp32
    values (e4m3 saturated to +-448, NaN and inf as 0x7F; bf16 rounded to nearest even, NaN as
    0x7FC0) and every e4m3 code; also with a scale that makes finite values overflow to inf
    (the conversion's own saturation stands in for the clamp to +-448)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()}: the kernels use no conversion instructions")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _cvt_check as C

    assert C.compare(C.PLANTED, True, False, 2**32 - 4096 * 2, 4096 * 2, "cuda") == (1170, 2**32 - 8187)
    for what, n in ((C.ENCODE, 2**32), (C.ENCODE_OVERFLOW, 2**32), (C.BF16, 2**32), (C.DECODE, 4096)):
        assert C.compare(what, True, False, 0, n, "cuda") == (0, None), what


_CVT_SWITCH = r"""
import torch
from fsdp_native import quant as Q
Q._import_triton_kernels()
from fsdp_native.kernels import quant as K
print(K.HW_CVT, K._cvt(torch.device("cpu")))
"""


@pytest.mark.skipif(not _triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("value, want", [(None, "True False"), ("0", "False False"), ("1", "True False")])
def test_conversion_instructions_switch(value, want):
    """FSDP_NATIVE_TRITON_CVT=0 turns the conversion instructions off (HW_CVT); CPU tensors
    never take them, whatever the switch."""
    env = {k: v for k, v in os.environ.items() if k != "FSDP_NATIVE_TRITON_CVT"}
    if value is not None:
        env["FSDP_NATIVE_TRITON_CVT"] = value
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _CVT_SWITCH], env=env, cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == want.split(), r.stdout


_SOURCE_CHECKOUT = r"""
import sys
# as in a source checkout on PYTHONPATH: no installed package maps kernels/ to fsdp_native.kernels
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
import torch
from fsdp_native import quant as Q
import fsdp_native
assert "fsdp_native.kernels" not in sys.modules
try:
    import fsdp_native.kernels
    raise AssertionError("fsdp_native.kernels importable without the mapping")
except ModuleNotFoundError:
    pass
Q._import_triton_kernels()
print(sys.modules["fsdp_native.kernels.quant"].__file__)
x = torch.linspace(-3, 3, 64)
a, b = torch.empty(80, dtype=torch.uint8), torch.zeros(80, dtype=torch.uint8)
torch.ops.fsdp_native.quantize_copy_in([x], [64], [1], "fp8_tensorwise", 64, None, a)
torch.ops.fsdp_native.quantize_copy_in_triton([x], [64], [1], "fp8_tensorwise", 64, None, b)
assert torch.equal(a, b)
print("ok")
"""


@pytest.mark.skipif(not _triton_available(), reason="triton is not installed")
def test_triton_kernels_from_a_source_checkout(tmp_path):
    """Built in place and used from PYTHONPATH (the GPU machine's recipe), fsdp_native finds
    its Triton kernels in the repository's kernels/ as an install does. The checkout is made
    in tmp_path: the fsdp_native package now imported (its extension built for this torch)
    without any kernels subpackage, beside the repository's kernels/."""
    import shutil

    import fsdp_native

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = shutil.ignore_patterns("kernels", "__pycache__")
    shutil.copytree(os.path.dirname(os.path.abspath(fsdp_native.__file__)), tmp_path / "fsdp_native", ignore=skip)
    shutil.copytree(os.path.join(root, "kernels"), tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _SOURCE_CHECKOUT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.split() == [str(tmp_path / "kernels" / "quant.py"), "ok"], r.stdout


_VERSIONS = r"""
import torch
from fsdp_native import quant as Q
Q._import_triton_kernels()
ns = torch.ops.fsdp_native
fmt, padded, rows = "fp8_rowwise", [64], [8]
chunk = torch.empty(Q.unit_layout(padded, rows, fmt).rank_nbytes, dtype=torch.uint8)
Q.quantize_copy_in([torch.linspace(-2, 2, 64)], padded, rows, chunk, format=fmt)
from fsdp_native.kernels import quant as K
for name, ops in (("C++", None),
                  ("Triton op", Q._Ops(ns.quantize_copy_in_triton, ns.dequantize_copy_out_triton, ns.quantize_amax_triton, True)),
                  ("Triton eager", Q._Ops(K.quantize_copy_in_eager, K.dequantize_copy_out_eager, K.quantize_amax_eager, False))):
    if ops is not None:
        Q._ops_for = lambda t: ops  # the CUDA path's ops (traced, and eager), on CPU tensors (interpreted)
    w = torch.zeros(2 * 64)
    saved = w.view(16, 8)  # as autograd saves an unsharded parameter in the forward
    before = saved._version
    Q.dequantize_copy_out(chunk.repeat(2), padded, rows, 2, [w], format=fmt)
    assert torch.equal(w[:64], w[64:]) and w.abs().max() > 1, name
    assert saved._version == before, f"{name}: version {saved._version}, was {before}"
print("versions kept")
"""


@pytest.mark.skipif(not _triton_available(), reason="triton is not installed")
def test_dequantize_keeps_autograd_versions():
    """Refilling an unsharded parameter that the backward saved must not look like an in-place
    change to autograd: with the Triton op it did, and the GPU backward failed ("modified by an
    inplace operation")."""
    env = dict(os.environ, TRITON_INTERPRET="1")  # cwd: the tests, not a checkout's fsdp_native
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _VERSIONS], env=env, cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "versions kept" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def triton_vs_cpp(dev: torch.device, big: bool = False) -> None:
    """The Triton ops on ``dev`` (CPU tensors under TRITON_INTERPRET=1, or CUDA) against the C++
    ops on CPU tensors, bit for bit: quantized bytes, dequantized values, amaxes, messages."""
    Q._import_triton_kernels()
    ns = torch.ops.fsdp_native
    tq, tdq = ns.quantize_copy_in_triton, ns.dequantize_copy_out_triton

    def on(ts):
        return [t.to(dev) for t in ts]

    gen = torch.Generator().manual_seed(8)
    shapes = [(), (1,), (0,), (4, 0), (3, 5), (9, 2), (5, 130)]
    if big:
        shapes += [(1024, 4096 + 3), (3 * 4096 + 5,), (17, 3, 129)]
    # units of whole tiles (the kernels' unmasked path; fp8_rowwise rows a whole number of
    # tiles; at 3 ranks the last rank of (7, 1024) holds 2 rows of padding), then misaligned
    # buffers (every shard, output and gathered buffer one element off a 16-byte boundary)
    units = [shapes, [(24, 1024), (12, 2048), (7, 1024)], [(6, 2048 + 8), (3, 4096)]]
    # Every source and destination dtype on the small shapes; the larger units (the whole-tile
    # and misaligned paths, whose vector widths go by the element size) in fp32 and bf16: fp16
    # shares bf16's width and its casts are the small unit's. The interpreter's time goes by
    # programs, and these units have hundreds (91 -> 80 s a run; CI runs it on two torch
    # versions). On a GPU, every dtype everywhere.
    for u, shapes in enumerate(units):
        full = u == 0 or dev.type == "cuda"
        _triton_vs_cpp_unit(dev, shapes, gen, misaligned=u == 2, dtypes=FLOATS if full else (f32, bf16))
    # NF4 values on the midpoints and one fp32 step either side (scale 1: each block's largest
    # |x| is 1), where the code's last compare decides
    mids = torch.tensor(R.NF4_MIDPOINTS, dtype=f32)
    edge = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
    block = torch.cat([torch.tensor([1.0, -1.0]), edge, torch.zeros(64 - 2 - edge.numel())])
    _triton_round_trip(dev, [torch.stack([block, block.flip(0)])], 2, Q.NF4, (f32,), False)
    # fp8_rowwise rows below 1 in magnitude and not a power of two long, several to a program,
    # whole programs of data and not (the tiles a row does not have must not count in its amax)
    for src in (f32, bf16):
        fulls = [make_values((12, 1000), src, gen, scale=1e-3), make_values((64, 96), src, gen, scale=1e-3)]
        for ws in (2, 3):
            _triton_round_trip(dev, fulls, ws, Q.FP8_ROWWISE, (bf16,), False)
    # shards that end within a row (the ops allow any numel up to the padded size)
    for fmt in Q.FORMATS:
        shards = [make_values((1000,), bf16, gen, special=True), make_values((3000,), f32, gen, special=True)]
        padded, rows = [2048, 4096], [1024, 2048]
        n = Q.unit_layout(padded, rows, fmt).rank_nbytes
        a, b = torch.zeros(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8, device=dev)
        ns.quantize_copy_in(shards, padded, rows, fmt, 64, None, a)
        tq(on(shards), padded, rows, fmt, 64, None, b)
        assert torch.equal(a, b.cpu()), (fmt, (a != b.cpu()).nonzero().view(-1)[:8].tolist())
    # mixed source dtypes in one unit, a given amax, a [world_size, n] view, block sizes, amax op
    shards = [make_values((40,), bf16, gen, special=True), make_values((33,), f32, gen)]
    padded, rows = [40, 34], [8, 17]
    amax = torch.tensor([2.5, float("nan")])
    for fmt, bs, am in (("fp8_tensorwise", 64, amax), ("fp8_rowwise", 64, None), ("nf4", 2, None), ("nf4", 256, None)):
        n = Q.unit_layout(padded, rows, fmt, block_size=bs).rank_nbytes
        a, b = torch.zeros(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8, device=dev)
        ns.quantize_copy_in(shards, padded, rows, fmt, bs, am, a)
        tq(on(shards), padded, rows, fmt, bs, None if am is None else am.to(dev), b)
        assert torch.equal(a, b.cpu()), (fmt, bs)
        buf = torch.zeros(2, n + 16, dtype=torch.uint8)
        buf[0, :n], buf[1, :n] = a, a
        o1 = [torch.empty(80, dtype=bf16), torch.empty(60)]
        o2 = on([torch.empty(80, dtype=bf16), torch.empty(60)])
        ns.dequantize_copy_out(buf[:, :n], padded, rows, 2, fmt, bs, o1)
        tdq(buf.to(dev)[:, :n], padded, rows, 2, fmt, bs, o2)
        assert all(same_bits(x, y.cpu()) for x, y in zip(o1, o2)), (fmt, bs)
    # a unit's launch tables are made once and reused (no host-to-device copy per call)
    from fsdp_native.kernels import quant as K

    dshards = on(shards)
    n = Q.unit_layout(padded, rows, "fp8_rowwise").rank_nbytes
    o1, o2 = torch.zeros(n, dtype=torch.uint8, device=dev), torch.ones(n, dtype=torch.uint8, device=dev)
    tq(dshards, padded, rows, "fp8_rowwise", 64, None, o1)
    cached = dict(K._TABLES)
    tq(dshards, padded, rows, "fp8_rowwise", 64, None, o1)
    assert K._TABLES.keys() == cached.keys() and all(K._TABLES[k] is v for k, v in cached.items())
    tq([t.clone() for t in dshards], padded, rows, "fp8_rowwise", 64, None, o2)  # other sources: other tables
    assert len(K._TABLES) > len(cached) and torch.equal(o1, o2)
    # a call like an earlier one reuses its plan without checking its arguments again; a plan
    # keeps none of the call's tensors alive; a call that differs in anything checked is
    # checked (and fails with the op's message)
    import gc
    import weakref

    checks = []
    real_check = Q.check_quantize_args
    Q.check_quantize_args = lambda *a: checks.append(1) or real_check(*a)
    try:
        plans = len(K._PLANS)
        tq(dshards, padded, rows, "fp8_rowwise", 64, None, o1)
        assert checks == [] and len(K._PLANS) == plans
        tq(dshards, padded, rows, "fp8_tensorwise", 64, None, torch.empty(Q.unit_layout(padded, rows, "fp8_tensorwise").rank_nbytes,
                                                                         dtype=torch.uint8, device=dev))  # fmt: skip
        assert checks == [1] and len(K._PLANS) == plans + 1
        for bad, message in ((torch.ones(3, device=dev), "argument 'amax' has 3 elements, expected 2"),
                             (torch.ones(2, device=dev, dtype=torch.float64), "argument 'amax' has dtype torch.float64")):  # fmt: skip
            n8 = Q.unit_layout(padded, rows, "fp8_tensorwise").rank_nbytes
            try:
                tq(dshards, padded, rows, "fp8_tensorwise", 64, bad, torch.empty(n8, dtype=torch.uint8, device=dev))
                raise AssertionError("no error")
            except RuntimeError as e:
                assert message in str(e), str(e)
    finally:
        Q.check_quantize_args = real_check
    out_buf = torch.empty(n, dtype=torch.uint8, device=dev)
    g_buf, w_out = torch.zeros(2, n, dtype=torch.uint8, device=dev), torch.empty(80, dtype=bf16, device=dev)
    refs = [weakref.ref(t) for t in (out_buf, g_buf, w_out)]
    tq(dshards, padded, rows, "fp8_rowwise", 64, None, out_buf)
    tdq(g_buf, padded, rows, 2, "fp8_rowwise", 64, [w_out, torch.empty(60, device=dev)])
    del out_buf, g_buf, w_out
    gc.collect()
    assert all(r() is None for r in refs), "a plan keeps a buffer of the call alive"
    m1, m2 = torch.empty(2), torch.empty(2, device=dev)
    ns.quantize_amax(shards, m1)
    ns.quantize_amax_triton(on(shards), m2)
    assert torch.equal(m1, m2.cpu())
    # same messages as C++
    try:
        tq(on([torch.ones(10, dtype=torch.int32)]), [10], [1], "nf4", 64, None, torch.empty(16, dtype=torch.uint8, device=dev))
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "argument 'shards[0]' has dtype torch.int32" in str(e)
    n = Q.unit_layout(padded, rows, "nf4").rank_nbytes
    torch.library.opcheck(tq, (on(shards), padded, rows, "nf4", 64, None, torch.empty(n, dtype=torch.uint8, device=dev)),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    g = torch.zeros(2 * n, dtype=torch.uint8, device=dev)
    torch.library.opcheck(tdq, (g, padded, rows, 2, "nf4", 64, on([torch.empty(80), torch.empty(60)])),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip



def _off(t: torch.Tensor, misaligned: bool) -> torch.Tensor:
    """`t`, or a copy of it one element past a fresh buffer's start (not 16-byte aligned)."""
    if not misaligned:
        return t
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    buf[1:].copy_(t.reshape(-1))
    return buf[1:].view(t.shape)


def _triton_vs_cpp_unit(dev, shapes, gen, misaligned: bool, dtypes=FLOATS) -> None:
    """triton_vs_cpp's round trip of one unit of `shapes` at 3 ranks, every format, each of
    `dtypes` as source and as destination."""
    for fmt in Q.FORMATS:
        for src in dtypes:
            fulls = [make_values(s, src, gen, special=True) for s in shapes]
            _triton_round_trip(dev, fulls, 3, fmt, dtypes, misaligned, garbage=True)


def _triton_round_trip(dev, fulls, ws: int, fmt: str, out_dtypes, misaligned: bool, garbage: bool = False) -> None:
    """Every rank's shards of `fulls` quantized by the Triton op on `dev` and by the C++ op,
    bit for bit, then the gathered chunks (`garbage`: the last 7 bytes 0xFF, garbage scales
    and codes) dequantized into each of `out_dtypes` by both, bit for bit; `misaligned`: every
    Triton buffer one element off 16 bytes."""
    ns = torch.ops.fsdp_native
    Q._import_triton_kernels()
    padded = [padded_shard_numel(f.shape, ws) for f in fulls]
    rows = [row_numel(f.shape) for f in fulls]
    n = Q.unit_layout(padded, rows, fmt).rank_nbytes
    what = ([tuple(f.shape) for f in fulls], ws, fmt, fulls[0].dtype if fulls else None)
    chunks = []
    for r in range(ws):
        shards = [shards_of(f, p, r) for f, p in zip(fulls, padded)]
        a = torch.full((n,), 0x11, dtype=torch.uint8)
        b = _off(torch.full((n,), 0x22, dtype=torch.uint8, device=dev), misaligned)
        ns.quantize_copy_in(shards, padded, rows, fmt, 64, None, a)
        ns.quantize_copy_in_triton([_off(t.to(dev), misaligned) for t in shards], padded, rows, fmt, 64, None, b)
        b = b.cpu()
        assert torch.equal(a, b), (what, r, (a != b).nonzero().view(-1)[:8].tolist())
        chunks.append(a)
    g = torch.cat(chunks)
    if garbage:
        g[-7:] = 0xFF
    for out_dtype in out_dtypes:
        o1 = [torch.empty(f.numel(), dtype=out_dtype) for f in fulls]
        o2 = [_off(torch.full((f.numel(),), 3.0, dtype=out_dtype, device=dev), misaligned) for f in fulls]
        ns.dequantize_copy_out(g, padded, rows, ws, fmt, 64, o1)
        ns.dequantize_copy_out_triton(_off(g.to(dev), misaligned), padded, rows, ws, fmt, 64, o2)
        assert all(same_bits(x, y.cpu()) for x, y in zip(o1, o2)), (what, out_dtype)


if __name__ == "__main__" and "--triton" in sys.argv:
    triton_main()


def nf4_cubic_bad(v: torch.Tensor) -> int:
    """How many of the fp32 values ``v`` the NF4 quantize kernel's cubic (kernels/quant.py
    NF4_CUBIC) truncates to a k that is neither their code (the count of midpoints below) nor
    one below it, or outside 0-14: evaluated with fused multiply-adds (the GPU; each rounded
    once) and with separate multiplies and adds (the interpreter)."""
    Q._import_triton_kernels()
    from fsdp_native.kernels import quant as K

    c0, c1, c2, c3 = K.NF4_CUBIC
    code = torch.searchsorted(torch.tensor(R.NF4_MIDPOINTS, dtype=torch.float32), v)
    vd = v.double()
    t = (vd * c3 + c2).float().double()
    t = (t * vd + c1).float().double()
    fused = (t * vd + c0).float()
    separate = ((v * c3 + c2) * v + c1) * v + c0
    bad = 0
    for h in (fused, separate):
        k = h.trunc().long()
        bad += int(((h < 0) | (k > 14) | ((k != code) & (k != code - 1))).sum())
    return bad


def _f32_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values from keys in their order (0: +0; -n: the n-th fp32 below zero)."""
    bits = torch.where(keys >= 0, keys, (-keys) | (1 << 31)).to(torch.int64)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)


_NF4_V_MAX = int(torch.tensor(1.001, dtype=torch.float32).view(torch.int32))  # |v| <= 1.001, as a key


def nf4_cubic_check_all() -> int:
    """nf4_cubic_bad over every fp32 with |v| <= 1.001 (2^31 values; a few minutes)."""
    bad, step = 0, 1 << 24
    for lo in range(-_NF4_V_MAX, _NF4_V_MAX + 1, step):
        bad += nf4_cubic_bad(_f32_from_keys(torch.arange(lo, min(lo + step, _NF4_V_MAX + 1), dtype=torch.int64)))
    return bad


@pytest.mark.skipif(not _triton_available(), reason="triton is not installed")
def test_nf4_cubic_finds_every_code():
    """The NF4 quantize kernel's code is trunc(h(v)) or one more, by one compare; h must never
    miss by more. Every fp32 within 2^16 of each midpoint and of each point where h steps over
    an integer, the ends, and 2^24 others (uniform in value and in bit pattern); every fp32 of
    |v| <= 1.001 by `python tests/test_quant_kernels.py --nf4-cubic` (0 misses; 3-5 minutes)."""
    from fsdp_native.kernels import quant as K

    c0, c1, c2, c3 = K.NF4_CUBIC
    grid = torch.linspace(-1.001, 1.001, 2_000_001, dtype=torch.float64)
    h = ((grid * c3 + c2) * grid + c1) * grid + c0
    steps = torch.nonzero(h.floor()[1:] != h.floor()[:-1]).view(-1)
    assert 14 <= len(steps) <= 20, len(steps)  # h rises through 0-15 once (it may turn near the ends)
    points = torch.cat([grid[steps], torch.tensor(R.NF4_MIDPOINTS, dtype=torch.float64), torch.tensor([-1.001, 0.0, 1.001])])
    bits = points.float().view(torch.int32).long()
    keys = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))
    near = (keys[:, None] + torch.arange(-(1 << 16), 1 << 16)).view(-1).clamp(-_NF4_V_MAX, _NF4_V_MAX)
    gen = torch.Generator().manual_seed(0)
    uniform = torch.rand(1 << 23, generator=gen, dtype=torch.float64) * 2.002 - 1.001
    any_bits = _f32_from_keys(torch.randint(-_NF4_V_MAX, _NF4_V_MAX + 1, (1 << 23,), generator=gen))
    assert nf4_cubic_bad(torch.cat([_f32_from_keys(near), uniform.float(), any_bits])) == 0
    # a cubic a little off is caught
    saved = K.NF4_CUBIC
    try:
        K.NF4_CUBIC = (saved[0] + 0.45, *saved[1:])
        assert nf4_cubic_bad(_f32_from_keys(near)) > 0
    finally:
        K.NF4_CUBIC = saved


if __name__ == "__main__" and "--nf4-cubic" in sys.argv:
    t0 = time.time()
    print(f"NF4 cubic: {nf4_cubic_check_all()} misses over every fp32 with |v| <= 1.001 ({time.time() - t0:.0f} s)")


# ----------------------------------------------------------------------------- CPU kernel levels
_BIT_EXACT = "grid_matches or every or long_runs or non_finite or nf4_runs or tiny_amax or hypothesis or multithreaded or global_amax or garbage or rows_of or misaligned"


def test_cpu_kernel_level_is_reported():
    want = os.environ.get("FSDP_NATIVE_QUANT_ISA", "auto").strip().lower()
    got = torch.ops.fsdp_native.quant_cpu_isa()
    assert got in ("avx512-vbmi", "avx512", "avx2", "portable"), got
    if want == "portable":
        assert got == "portable"
    elif want == "avx2":
        assert got in ("avx2", "portable"), got  # capped at avx2; less on a CPU without it
    elif want == "avx512":
        assert got in ("avx512", "avx2", "portable"), got  # capped at avx512; less on a CPU without it


@pytest.mark.parametrize("level", ["avx512", "avx2", "portable"])
def test_bit_exact_at_every_cpu_kernel_level(level):
    """The default run tests the best kernels the CPU has; the others are the fallbacks other
    CPUs (and rare scales) run: the same bit-exact tests with the level capped."""
    if os.environ.get("FSDP_NATIVE_QUANT_ISA"):
        pytest.skip("already running at a capped level")
    env = dict(os.environ, FSDP_NATIVE_QUANT_ISA=level)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", _BIT_EXACT + " or level_is_reported"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-1000:]


def test_bad_cpu_kernel_level_fails_import():
    env = dict(os.environ, FSDP_NATIVE_QUANT_ISA="avx9000")
    r = subprocess.run([sys.executable, "-c", "import fsdp_native"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert (
        "ValueError: fsdp_native: environment variable FSDP_NATIVE_QUANT_ISA must be one of auto, avx512, avx2, portable, got 'avx9000'"
        in r.stderr
    ), r.stderr[-500:]
