"""Plain PyTorch reference of the quantized all-gather formats (``fsdp_native.quant``).

Parameter by parameter with ordinary tensor ops; the C++ kernels (csrc/cpu/quant_cpu.cpp,
math in csrc/quant_math.h) and the Triton kernels (kernels/quant.py) must write the same bytes
and the same dequantized values, bit for bit. The rules are stated once, in
``fsdp_native/quant.py``'s module docstring.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_native.quant import FP8_ROWWISE, NF4, segment_layout

E4M3_MAX = 448.0
MIN_FP8_SCALE = 2.0**-126
# QLoRA's NF4 values and the midpoints between neighbours, as fp32 (hex: exact).
NF4_VALUES = [float.fromhex(h) for h in (
    "-0x1p+0", "-0x1.647362p-1", "-0x1.0cd66p-1", "-0x1.94654p-2", "-0x1.23449ap-2",
    "-0x1.7a6a7ep-3", "-0x1.74f0e2p-4", "0x0p+0", "0x1.45f5fep-4", "0x1.4995c6p-3",
    "0x1.f809bap-3", "0x1.5a0674p-2", "0x1.c3497p-2", "0x1.200f56p-1", "0x1.722766p-1", "0x1p+0",
)]  # fmt: skip
NF4_MIDPOINTS = [float.fromhex(h) for h in (
    "-0x1.b239bp-1", "-0x1.38a4ep-1", "-0x1.d709p-2", "-0x1.5bd4ecp-2", "-0x1.e079d8p-3",
    "-0x1.1a7178p-3", "-0x1.74f0e2p-5", "0x1.45f5fep-5", "0x1.ec90c4p-4", "0x1.a0cfcp-3",
    "0x1.2b05a8p-2", "0x1.8ea7f2p-2", "0x1.00da08p-1", "0x1.491b5ep-1", "0x1.b913b4p-1",
)]  # fmt: skip
_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales from fp32 amaxes: amax / 448, at least 2^-126; 1 where amax is not a
    positive finite number."""
    s = torch.clamp(amax / torch.full_like(amax, E4M3_MAX), min=MIN_FP8_SCALE)
    return torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(amax))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest |x| over the finite values of fp32 ``x`` (0 when there are none)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).max()


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) of fp32 ``x`` for per-element fp32 ``scale`` (same shape)."""
    q = torch.clamp(x * (torch.ones_like(scale) / scale), -E4M3_MAX, E4M3_MAX)
    codes = torch.where(torch.isfinite(x), q, torch.zeros_like(q)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isfinite(x), codes, torch.full_like(codes, 0x7F))


def _padded_float(shard: torch.Tensor, n: int) -> torch.Tensor:
    x = torch.zeros(n, dtype=torch.float32)
    x[: shard.numel()] = shard.reshape(-1).float()
    return x


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def quantize(
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int],
    row_numels: Sequence[int],
    fmt: str,
    block_size: int = 64,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's encoded chunk (uint8) of the unit."""
    chunks = []
    for i, (shard, padded, row) in enumerate(zip(shards, padded_numels, row_numels)):
        seg = segment_layout(padded, row, fmt, block_size=block_size)
        out = torch.zeros(seg.nbytes, dtype=torch.uint8)
        chunks.append(out)
        if padded == 0:
            continue
        if fmt == NF4:
            n_blocks = seg.n_scales
            x = _padded_float(shard, n_blocks * block_size).view(n_blocks, block_size)
            absmax = x.abs().amax(dim=1)
            scale = torch.where(absmax == 0, torch.ones_like(absmax), torch.clamp(absmax, min=MIN_FP8_SCALE))
            scale = torch.where(torch.isfinite(absmax), scale, torch.full_like(absmax, float("nan")))
            v = x * (torch.ones_like(scale) / scale)[:, None].expand_as(x).contiguous()
            mids = torch.tensor(NF4_MIDPOINTS, dtype=torch.float32)
            codes = (v[..., None] > mids).sum(-1).to(torch.uint8).view(-1)
            packed = (codes[0::2] << 4) | codes[1::2]
            out[: seg.data_nbytes] = packed[: seg.data_nbytes]
        else:
            x = _padded_float(shard, padded)
            if fmt == FP8_ROWWISE:
                rows = x.view(padded // row, row)
                amax_rows = torch.where(torch.isfinite(rows), rows.abs(), torch.zeros_like(rows)).amax(dim=1)
                scale = fp8_scale(amax_rows)
                codes = _fp8_codes(rows, scale[:, None].expand_as(rows).contiguous()).view(-1)
            else:
                a = finite_amax(x) if amax is None else amax[i].reshape(())
                scale = fp8_scale(a.reshape(1))
                codes = _fp8_codes(x, scale.expand_as(x).contiguous())
            out[:padded] = codes
        out[seg.scale_offset : seg.scale_offset + 4 * seg.n_scales] = _bytes_of(scale.float())
    if not chunks:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(chunks)


def _store(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``v`` cast to ``dtype``, every NaN written as the dtype's one NaN."""
    out = v.to(dtype)
    bits = out.view({4: torch.int32, 2: torch.int16}[out.element_size()])
    nan = _NAN_BITS[dtype]
    nan = nan - (1 << (8 * out.element_size())) if nan >= 1 << (8 * out.element_size() - 1) else nan
    return torch.where(torch.isnan(out), torch.full_like(bits, nan), bits).view(dtype)


def dequantize(
    gathered: torch.Tensor,
    padded_numels: Sequence[int],
    row_numels: Sequence[int],
    world_size: int,
    fmt: str,
    numels: Sequence[int],
    dtypes: Sequence[torch.dtype],
    block_size: int = 64,
) -> list[torch.Tensor]:
    """The unsharded tensors (flat, ``numels[i]`` elements of ``dtypes[i]``) from a gathered
    buffer of ``world_size`` chunks."""
    segs = [segment_layout(p, r, fmt, block_size=block_size) for p, r in zip(padded_numels, row_numels)]
    chunk = sum(s.nbytes for s in segs)
    gathered = gathered.reshape(world_size, chunk)
    outs = []
    offset = 0
    for seg, padded, row, numel, dtype in zip(segs, padded_numels, row_numels, numels, dtypes):
        parts = []
        for r in range(world_size):
            valid = max(0, min(padded, numel - r * padded))
            if valid == 0:
                break
            b = gathered[r, offset : offset + seg.nbytes].clone()
            scales = b[seg.scale_offset : seg.scale_offset + 4 * seg.n_scales].clone().view(torch.float32)
            if fmt == NF4:
                codes = b[: seg.data_nbytes]
                c = torch.stack([codes >> 4, codes & 15], dim=1).view(-1)[:valid].long()
                vals = torch.tensor(NF4_VALUES, dtype=torch.float32)[c]
                s = scales.repeat_interleave(block_size)[:valid]
            else:
                vals = b[:valid].view(torch.float8_e4m3fn).float()
                s = scales.repeat_interleave(row)[:valid] if fmt == FP8_ROWWISE else scales.expand(valid).contiguous()
            parts.append(_store(vals * s, dtype))
        outs.append(torch.cat(parts) if parts else torch.zeros(0, dtype=dtype))
        offset += seg.nbytes
    return outs


__all__ = ["quantize", "dequantize", "fp8_scale", "finite_amax", "NF4_VALUES", "NF4_MIDPOINTS"]
