"""Triton kernels of fsdp_native's quantized all-gather formats (``fsdp_native.quant``), for
CUDA tensors; tested on CPU tensors with ``TRITON_INTERPRET=1``.

Ops: ``fsdp_native::quantize_copy_in_triton``, ``dequantize_copy_out_triton`` and
``quantize_amax_triton``, with the schemas, argument checks and error messages of the C++
ops (csrc/quant.cpp), and the same bytes and values bit for bit (the math of
csrc/quant_math.h restated: integer bit manipulation for the e4m3 and bf16 roundings,
``div_rn`` for the correctly rounded reciprocals, no fused multiply-adds).

One launch covers a whole unit (one per source or destination dtype present, usually one;
fp8_tensorwise adds the amax launch): every program finds its parameter by a binary search
over a table of per-parameter task counts and reaches the parameter's tensor through a table
of data pointers. A variable number of tensors behind a pointer table is also why these are
``torch.library.custom_op``s and not ``triton_op``s: ``triton_op`` lets torch.compile trace
into the implementation and infer what each kernel reads and writes from its tensor
arguments, which cannot see tensors reached through pointers, and it runs the implementation
on fake tensors, which have no data pointers. An opaque custom op with the mutated arguments
in its schema stays correct under torch.compile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsdp_native import quant as Q
from fsdp_native._quant_ref import NF4_VALUES

# Elements per program (a row for fp8_rowwise), and per inner step.
TASK = 4096
BLOCK = 1024

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Compile options: no fused multiply-adds, and libdevice (div_rn) without flushing subnormals
# to zero, so the GPU rounds as the C++ kernels and the reference do.
_OPTS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


# --------------------------------------------------------------------------------------------
# element math (csrc/quant_math.h)


@triton.jit
def _find_param(starts, n_params, pid, LOG2: tl.constexpr):
    """The last parameter p with starts[p] <= pid (parameters without tasks are skipped)."""
    lo = pid * 0
    hi = lo + n_params - 1
    for _ in tl.static_range(LOG2):
        mid = (lo + hi + 1) // 2
        go = (tl.load(starts + mid) <= pid).to(tl.int64)  # arithmetic, not tl.where: scalars
        lo = lo + go * (mid - lo)
        hi = mid - 1 + go * (hi - mid + 1)
    return lo


@triton.jit
def _load_src(addr, i, mask, SRC: tl.constexpr):
    """fp32 values of elements ``i`` at raw address ``addr`` of dtype SRC (0 fp32, 1 bf16,
    2 f16); 0 where masked. bf16 widens by its bits (exact everywhere, subnormals included)."""
    if SRC == 0:
        return tl.load(addr.to(tl.pointer_type(tl.float32)) + i, mask=mask, other=0.0)
    elif SRC == 1:
        h = tl.load(addr.to(tl.pointer_type(tl.uint16)) + i, mask=mask, other=0)
        return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(addr.to(tl.pointer_type(tl.float16)) + i, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fp8_scale(amax):
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    return tl.where((amax > 0.0) & (amax <= 3.4028234663852886e38), s, 1.0)


@triton.jit
def _finite_abs_bits(x):
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(a < 0x7F800000, a, 0)


@triton.jit
def _fp8_encode(x, inv_scale):
    q = x * inv_scale
    c = tl.minimum(tl.maximum(q, -448.0), 448.0)
    u = c.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    code = tl.where(a < 0x3C800000, sub, normal) | sign
    finite = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    return tl.where(finite, code, 0x7F).to(tl.uint8)


@triton.jit
def _e4m3_value(b):
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    normal = ((e + 120) << 23) | (m << 20)
    bits = tl.where(e == 0, sub, normal) | sign
    bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nf4_code(v):
    # the number of NF4 midpoints (fp32, _quant_ref.NF4_MIDPOINTS) below v
    c = (v > -0.8480963706970215).to(tl.int32)
    c += (v > -0.6106328964233398).to(tl.int32)
    c += (v > -0.4599952697753906).to(tl.int32)
    c += (v > -0.33967941999435425).to(tl.int32)
    c += (v > -0.23460739850997925).to(tl.int32)
    c += (v > -0.13791173696517944).to(tl.int32)
    c += (v > -0.045525018125772476).to(tl.int32)
    c += (v > 0.03979014977812767).to(tl.int32)
    c += (v > 0.120255246758461).to(tl.int32)
    c += (v > 0.2035212516784668).to(tl.int32)
    c += (v > 0.2920137643814087).to(tl.int32)
    c += (v > 0.3893125355243683).to(tl.int32)
    c += (v > 0.5016634464263916).to(tl.int32)
    c += (v > 0.6427869200706482).to(tl.int32)
    c += (v > 0.8614784479141235).to(tl.int32)
    return c


@triton.jit
def _store_out(addr, v, mask, OUT: tl.constexpr):
    """Stores fp32 ``v`` at raw address ``addr`` (int64) as OUT (0 fp32, 1 bf16, 2 f16),
    rounding to nearest even, every NaN as the dtype's one NaN."""
    u = v.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if OUT == 0:
        tl.store(addr.to(tl.pointer_type(tl.uint32)), tl.where(nan, 0x7FC00000, u), mask=mask)
    elif OUT == 1:
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
        tl.store(addr.to(tl.pointer_type(tl.uint16)), tl.where(nan, 0x7FC0, r).to(tl.uint16), mask=mask)
    else:
        h = v.to(tl.float16).to(tl.uint16, bitcast=True)
        tl.store(addr.to(tl.pointer_type(tl.uint16)), tl.where(nan, 0x7E00, h).to(tl.uint16), mask=mask)


# Per-parameter table columns (int64). AIDX: where the parameter's amax lives in the amax
# array (tensorwise: its index; rowwise: the index of its first row).
_PTR, _NUMEL, _PADDED, _ROW, _SEG, _DATA_END, _SCALES, _SCALES_END, _SEG_END, _AIDX = range(10)
_COLS = 10


@triton.jit
def _load_meta(meta, p, col: tl.constexpr):
    return tl.load(meta + p * 10 + col)


# --------------------------------------------------------------------------------------------
# kernels: one tile of BLOCK elements per program and no loops with run-time bounds (the
# interpreter cannot run those with numpy 2.4)


@triton.jit
def _fp8_tile(meta, starts, n_params, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr):
    """This program's parameter and tile [lo, hi) of its padded shard; a rowwise tile lies
    within one row (row index ``r``)."""
    pid = tl.program_id(0).to(tl.int64)
    p = _find_param(starts, n_params, pid, LOG2)
    t = pid - tl.load(starts + p)
    padded = _load_meta(meta, p, 2)
    if ROWWISE:
        row = _load_meta(meta, p, 3)
        per_row = (row + BLOCK - 1) // BLOCK
        r = t // per_row
        lo = r * row + (t % per_row) * BLOCK
        hi = tl.minimum(lo + BLOCK, r * row + row)
    else:
        r = t * 0
        lo = t * BLOCK
        hi = tl.minimum(lo + BLOCK, padded)
    return p, r, lo, hi


@triton.jit
def _amax_kernel(meta, starts, amax_bits, n_params, SRC: tl.constexpr, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr):
    p, r, lo, hi = _fp8_tile(meta, starts, n_params, ROWWISE, LOG2, BLOCK)
    i = lo + tl.arange(0, BLOCK)
    x = _load_src(_load_meta(meta, p, 0), i, (i < hi) & (i < _load_meta(meta, p, 1)), SRC)
    tl.atomic_max(amax_bits + _load_meta(meta, p, 9) + r, tl.max(_finite_abs_bits(x), axis=0))


@triton.jit
def _fp8_quantize_kernel(
    meta, starts, out, amax, n_params, SRC: tl.constexpr, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr
):
    p, r, lo, hi = _fp8_tile(meta, starts, n_params, ROWWISE, LOG2, BLOCK)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    codes = out + _load_meta(meta, p, 4)
    scales = (out + _load_meta(meta, p, 6)).to(tl.pointer_type(tl.float32))
    scale = _fp8_scale(tl.load(amax + _load_meta(meta, p, 9) + r))
    first = lo == r * _load_meta(meta, p, 3) if ROWWISE else lo == 0
    tl.store(scales + r, scale, mask=first)
    i = lo + tl.arange(0, BLOCK)
    x = _load_src(src, i, (i < hi) & (i < numel), SRC)
    tl.store(codes + i, _fp8_encode(x, tl.math.div_rn(1.0, scale)), mask=i < hi)
    _zero_gaps_if(out, meta, p, hi == _load_meta(meta, p, 2))


@triton.jit
def _zero_gaps_if(out, meta, p, last):
    # A branch on the scalar, not `last & vector` as the mask: Triton 3.9's interpreter (the
    # Triton of torch 2.15) rejects a scalar-and-vector mask ("mask has unsupported dtype").
    if last:
        k = tl.arange(0, 16).to(tl.int64)
        data_end = _load_meta(meta, p, 5)
        scales = _load_meta(meta, p, 6)
        scales_end = _load_meta(meta, p, 7)
        seg_end = _load_meta(meta, p, 8)
        tl.store(out + data_end + k, tl.zeros([16], tl.uint8), mask=data_end + k < scales)
        tl.store(out + scales_end + k, tl.zeros([16], tl.uint8), mask=scales_end + k < seg_end)


@triton.jit
def _nf4_quantize_kernel(
    meta, starts, out, n_params, SRC: tl.constexpr, LOG2: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    p = _find_param(starts, n_params, pid, LOG2)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    padded = _load_meta(meta, p, 2)
    seg = _load_meta(meta, p, 4)
    data_end = _load_meta(meta, p, 5)
    scales = (out + _load_meta(meta, p, 6)).to(tl.pointer_type(tl.float32))
    t = pid - tl.load(starts + p)
    blk = t * NB + tl.arange(0, NB).to(tl.int64)
    bvalid = blk < (padded + BS - 1) // BS
    e0 = blk[:, None] * BS + 2 * tl.arange(0, BS // 2).to(tl.int64)[None, :]
    x0 = _load_src(src, e0, bvalid[:, None] & (e0 < numel), SRC)
    x1 = _load_src(src, e0 + 1, bvalid[:, None] & (e0 + 1 < numel), SRC)
    m0 = tl.max(x0.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    m1 = tl.max(x1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    m = tl.maximum(m0, m1)
    m = tl.where(m == 0, 0x3F800000, tl.maximum(m, 0x00800000))  # 1, or at least 2^-126
    scale = tl.where(m >= 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(1.0, scale)
    c0 = _nf4_code(x0 * inv[:, None])
    c1 = _nf4_code(x1 * inv[:, None])
    byte = ((c0 << 4) | c1).to(tl.uint8)
    b = e0 // 2
    tl.store(out + seg + b, byte, mask=bvalid[:, None] & (seg + b < data_end))
    tl.store(scales + blk, scale, mask=bvalid)
    _zero_gaps_if(out, meta, p, (t + 1) * NB * BS >= padded)


@triton.jit
def _dequantize_kernel(
    meta, starts, gathered, rank_stride, table, n_params,
    FMT: tl.constexpr, OUT: tl.constexpr, LOG2: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    p = _find_param(starts, n_params, pid, LOG2)
    dst = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    padded = _load_meta(meta, p, 2)
    per_rank = (padded + BLOCK - 1) // BLOCK
    t = pid - tl.load(starts + p)
    r = t // per_rank
    i = (t % per_rank) * BLOCK + tl.arange(0, BLOCK)
    valid = tl.minimum(tl.maximum(numel - r * padded, 0), padded)
    mask = i < valid
    chunk = gathered + r * rank_stride
    codes = chunk + _load_meta(meta, p, 4)
    scales = (chunk + _load_meta(meta, p, 6)).to(tl.pointer_type(tl.float32))
    if FMT == 2:
        b = tl.load(codes + i // 2, mask=mask, other=0).to(tl.uint32)
        code = tl.where(i % 2 == 0, b >> 4, b & 15)
        v = tl.load(table + code) * tl.load(scales + i // BS, mask=mask, other=1.0)
    else:
        b = tl.load(codes + i, mask=mask, other=0).to(tl.uint32)
        s_idx = i // _load_meta(meta, p, 3) if FMT == 1 else i * 0
        v = _e4m3_value(b) * tl.load(scales + s_idx, mask=mask, other=1.0)
    es = 4 if OUT == 0 else 2
    _store_out(dst + (r * padded + i) * es, v, mask, OUT)


# --------------------------------------------------------------------------------------------
# launches


def _log2(n: int) -> int:
    return max(1, (max(n, 1) - 1).bit_length() + 1)


# Device copies of the launch tables, by content. A unit's buffers stay put from step to step,
# so its tables repeat: without this, every call made two host-to-device copies from pageable
# memory, each of which synchronizes the stream before it starts. The kernels only read them.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}
_TABLES_MAX = 1024


def _launch_tables(rows: list[list[int]], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    key = (str(device), tuple(v for r in rows for v in r), tuple(counts))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, _COLS).to(device)
    hit = (meta, torch.tensor(starts, dtype=torch.int64).to(device), starts[-1])
    if len(_TABLES) >= _TABLES_MAX:  # the oldest first
        del _TABLES[next(iter(_TABLES))]
    _TABLES[key] = hit
    return hit


_NF4_TABLES: dict[str, torch.Tensor] = {}


def _nf4_table(device) -> torch.Tensor:
    t = _NF4_TABLES.get(str(device))
    if t is None:
        t = _NF4_TABLES[str(device)] = torch.tensor(NF4_VALUES, dtype=torch.float32).to(device)
    return t


def _groups(tensors) -> dict[torch.dtype, list[int]]:
    g: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        g.setdefault(t.dtype, []).append(i)
    return g


def _meta_row(ptr, numel, padded, row, seg: Q.Segment, aidx) -> list[int]:
    return [
        ptr, numel, padded, row, seg.offset, seg.offset + seg.data_nbytes, seg.offset + seg.scale_offset,
        seg.offset + seg.scale_offset + 4 * seg.n_scales, seg.offset + seg.nbytes, aidx,
    ]  # fmt: skip


def _nf4_blocks_per_program(block_size: int) -> int:
    return max(1, TASK // block_size)


def _fp8_tiles(padded: int, row: int, rowwise: bool) -> int:
    if padded == 0:
        return 0
    return (padded // row) * -(-row // BLOCK) if rowwise else -(-padded // BLOCK)


def _fp8_launch(kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, device, *args) -> None:
    """One launch of ``kernel`` per source dtype over every fp8 tile of the unit."""
    for dtype, idx in _groups(shards).items():
        rows = [_meta_row(shards[i].data_ptr(), shards[i].numel(), padded_numels[i], row_numels[i], segs[i], aidx[i]) for i in idx]
        counts = [_fp8_tiles(padded_numels[i], row_numels[i], rowwise) for i in idx]
        meta, starts, n = _launch_tables(rows, counts, device)
        if n:
            kernel[(n,)](meta, starts, *args, len(idx), SRC=_KIND[dtype], ROWWISE=rowwise, LOG2=_log2(len(idx)), BLOCK=BLOCK, **_OPTS)


@torch.library.custom_op("fsdp_native::quantize_amax_triton", mutates_args=("out",))
def quantize_amax_triton(shards: list[torch.Tensor], out: torch.Tensor) -> None:
    Q.check_amax_args(shards, out)
    bits = torch.zeros(len(shards), dtype=torch.int32, device=out.device)
    numels = [s.numel() for s in shards]
    empty = [Q.Segment(0, 0, 0, 0, 0)] * len(shards)
    _fp8_launch(_amax_kernel, shards, numels, [1] * len(shards), empty, False, range(len(shards)), out.device, bits)
    out.copy_(bits.view(torch.float32))


@torch.library.custom_op("fsdp_native::quantize_copy_in_triton", mutates_args=("out",))
def quantize_copy_in_triton(
    shards: list[torch.Tensor],
    padded_numels: list[int],
    row_numels: list[int],
    format: str,
    block_size: int,
    amax: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    layout = Q.check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out)
    segs = layout.segments
    if format == Q.NF4:
        for dtype, idx in _groups(shards).items():
            nb = _nf4_blocks_per_program(block_size)
            rows = [_meta_row(shards[i].data_ptr(), shards[i].numel(), padded_numels[i], row_numels[i], segs[i], 0) for i in idx]
            counts = [-(-segs[i].n_scales // nb) for i in idx]
            meta, starts, n = _launch_tables(rows, counts, out.device)
            if n:
                _nf4_quantize_kernel[(n,)](
                    meta, starts, out, len(idx), SRC=_KIND[dtype], LOG2=_log2(len(idx)), BS=block_size, NB=nb, **_OPTS
                )
        return
    rowwise = format == Q.FP8_ROWWISE
    if rowwise:  # amax of every row of the unit, then the codes
        aidx, total = [], 0
        for s in segs:
            aidx.append(total)
            total += s.n_scales
    else:
        aidx, total = list(range(len(shards))), len(shards)
    if amax is None:
        bits = torch.zeros(total, dtype=torch.int32, device=out.device)
        _fp8_launch(_amax_kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, out.device, bits)
        amax = bits.view(torch.float32)
    _fp8_launch(_fp8_quantize_kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, out.device, out, amax)


@torch.library.custom_op("fsdp_native::dequantize_copy_out_triton", mutates_args=("outs",))
def dequantize_copy_out_triton(
    gathered: torch.Tensor,
    padded_numels: list[int],
    row_numels: list[int],
    world_size: int,
    format: str,
    block_size: int,
    outs: list[torch.Tensor],
) -> None:
    layout = Q.check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs)
    rank_stride = gathered.stride(0) if gathered.dim() == 2 else layout.rank_nbytes
    table = _nf4_table(gathered.device)
    fmt = Q.FORMATS.index(format)
    for dtype, idx in _groups(outs).items():
        rows = [_meta_row(outs[i].data_ptr(), outs[i].numel(), padded_numels[i], row_numels[i], layout.segments[i], 0) for i in idx]
        counts = [world_size * -(-padded_numels[i] // BLOCK) if outs[i].numel() else 0 for i in idx]
        meta, starts, n = _launch_tables(rows, counts, gathered.device)
        if n:
            _dequantize_kernel[(n,)](
                meta, starts, gathered, rank_stride, table, len(idx),
                FMT=fmt, OUT=_KIND[dtype], LOG2=_log2(len(idx)), BS=block_size, BLOCK=BLOCK, **_OPTS,
            )  # fmt: skip


@quantize_copy_in_triton.register_fake
def _(shards, padded_numels, row_numels, format, block_size, amax, out):
    Q.check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out)


@dequantize_copy_out_triton.register_fake
def _(gathered, padded_numels, row_numels, world_size, format, block_size, outs):
    Q.check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs)


@quantize_amax_triton.register_fake
def _(shards, out):
    Q.check_amax_args(shards, out)
