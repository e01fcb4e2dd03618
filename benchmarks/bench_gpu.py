"""fsdp_native against torch FSDP2 on one GPU, at world size 8 on torch's fake process group,
and the CUDA packing ops against the bandwidth floor.

    python3 benchmarks/bench_gpu.py --json $OUT/bench_gpu.json          # on a GPU (BENCHMARKS.md, GPU)
    .venv/bin/python benchmarks/bench_gpu.py --smoke --json /tmp/s.json  # CPU, tiny models: code paths only

Training (one process, rank 0 of 8 on the fake process group: its collectives return at once
without writing their outputs, so copy-in/out, casts, streams, allocations, peak memory and
CPU overhead are real and communication time is not; the parameters hold garbage after the
first all-gather, which changes no shape, allocation or kernel):

* models: **overhead** (benchmarks/models.py: 32 residual MLP blocks, dim 128, hidden 256,
  per-rank input 4x8x128; fp32 and bf16 mixed precision) and **llama8b** (4 Llama-3-8B layers:
  dim 4096, hidden 14336, 32 heads / 8 KV heads, vocab 32000, sequence 4096, batch 1 per rank;
  bf16 parameters, fp32 reduction). Built on the meta device, each block a unit then the root,
  then ``to_empty(device)`` and every module's ``reset_parameters``; AdamW (lr 1e-3).
* step time: both implementations' models in the process, alternating blocks of steps (A B,
  B A, ...) after a warmup; a step is forward + loss + backward + ``optimizer.step()`` +
  ``zero_grad(set_to_none=True)``, timed from a device synchronize to the next; medians.
* memory, each implementation in its own run from its own start (``gc.collect()``,
  ``empty_cache``, ``reset_peak_memory_stats``; the previous run's model deleted): the step's
  peak (``max_memory_allocated``), memory between steps (``memory_allocated`` after
  ``optimizer.step()`` and ``zero_grad(set_to_none=True)``), and ``memory_allocated`` at the
  start of each block's backward (a hook on the gradient of the block's output), from the
  last of a few steps; all relative to the run's starting point.

Packing ops (``fsdp_native.ops``), CUDA events, median of ``--op-iters`` timings of
``--op-reps`` back-to-back calls, against the floor: one flat ``dst.copy_(src)`` of the same
numel and dtypes. "device" times queue a sleep kernel first so the host has queued every call
before the device starts (the kernels alone); "host" times do not (what a small op costs when
launch overhead shows). Work: one Llama-3-8B layer and the overhead model's block, sharded over
8 ranks (rank 3): copy-in fp32->bf16 and bf16->bf16, copy-out bf16, reduce-scatter copy-in
bf16 and bf16->fp32, reduce-scatter copy-out fp32 /8 and bf16->fp32 /8 accumulating.

--smoke runs all of it on the CPU with tiny models and shapes (fake process group, CPU timers,
no CUDA memory statistics), to exercise the code paths without a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

if "--smoke" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Fake works never report completion, so fsdp_native's CPU polling would spin its whole
    # budget on every wait (on CUDA nothing polls).
    os.environ.setdefault("FSDP_NATIVE_SPIN_US", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.models import MODEL_CONFIGS, Llama, LlamaConfig, ResidualMLP, init_weights, shard_model  # noqa: E402

WORLD_SIZE = 8
RANK = 3  # the rank whose shards the packing ops move

LLAMA = LlamaConfig()
LLAMA_SMOKE = LlamaConfig(dim=64, hidden=160, n_layers=2, n_heads=4, n_kv_heads=2, vocab=128, seq=32)
OVERHEAD = MODEL_CONFIGS["overhead"]
OVERHEAD_SMOKE = replace(OVERHEAD, dim=32, hidden=64, n_blocks=4, input_shape=(2, 4, 32))


@dataclass(frozen=True)
class TrainConfig:
    name: str
    model: str  # "overhead" or "llama"
    precision: str  # "fp32" or "bf16"
    warmup: int
    measured: int  # steps per implementation
    block: int  # steps per alternation block
    memory_steps: int
    # "plain"; "float8": torchao Float8 training with the float8 all-gather (every block Linear,
    # the output layer left in bf16) and precompute_float8_dynamic_scale_for_fsdp after each
    # optimizer step; "nf4-qlora": every block Linear's weight frozen as a torchao NF4Tensor with
    # a rank-16 fp32 LoRA adapter beside it, everything else frozen (torchtune's QLoRA)
    variant: str = "plain"
    impls: tuple[str, str] = ("torch", "fsdp_native")  # the ratio is impls[1] / impls[0]


CONFIGS = {
    "overhead-fp32": TrainConfig("overhead-fp32", "overhead", "fp32", 5, 40, 5, 3),
    "overhead-bf16": TrainConfig("overhead-bf16", "overhead", "bf16", 5, 40, 5, 3),
    "llama8b-bf16": TrainConfig("llama8b-bf16", "llama", "bf16", 2, 12, 2, 3),
    "llama8b-float8": TrainConfig("llama8b-float8", "llama", "bf16", 2, 12, 2, 3, variant="float8"),
    "llama8b-nf4-qlora": TrainConfig("llama8b-nf4-qlora", "llama", "bf16", 2, 12, 2, 3, variant="nf4-qlora"),
    # fsdp_native's own fp8 all-gather (bf16 compute) against its bf16 all-gather: with the fake
    # process group the bytes saved cost nothing here, so this is the quantization's own cost
    "llama8b-own-fp8": TrainConfig("llama8b-own-fp8", "llama", "bf16", 2, 12, 2, 3, impls=("fsdp_native", "fsdp_native:fp8_rowwise")),
}
LORA_RANK = 16


class NF4LoRALinear(torch.nn.Module):
    """A frozen NF4 weight (torchao ``to_nf4``) plus a trainable fp32 low-rank adapter."""

    def __init__(self, linear: torch.nn.Linear, block_size: int, scaler_block_size: int, rank: int = LORA_RANK):
        super().__init__()
        from torchao.quantization import to_nf4

        w = linear.weight.detach().to(torch.bfloat16)
        self.weight = torch.nn.Parameter(to_nf4(w, block_size=block_size, scaler_block_size=scaler_block_size), requires_grad=False)
        self.lora_a = torch.nn.Linear(w.shape[1], rank, bias=False, device=w.device)
        self.lora_b = torch.nn.Linear(rank, w.shape[0], bias=False, device=w.device)
        torch.nn.init.normal_(self.lora_b.weight, std=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x.to(torch.bfloat16), self.weight).to(x.dtype) + self.lora_b(self.lora_a(x))


def _to_nf4_qlora(model: torch.nn.Module, smoke: bool) -> None:
    # torchtune's block sizes; the smoke model's shards are too small for them (torchao wants
    # every shard to hold whole scaler blocks)
    sizes = (16, 4) if smoke else (64, 256)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for parent in [block, block.attention]:
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, NF4LoRALinear(child, *sizes))


@dataclass
class Env:
    device: torch.device
    smoke: bool
    cuda: bool = field(init=False)

    def __post_init__(self):
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None


# --------------------------------------------------------------------------------------------
# training


class Run:
    """One implementation's sharded model, optimizer and batches; `step()` is one training step
    with the memory probes."""

    def __init__(self, impl: str, tc: TrainConfig, env: Env, mesh):
        im = H.load_impl(impl)
        self.env, self.tc, self.impl = env, tc, impl
        mp = H.mixed_precision(im, tc.precision)
        # NF4 weights are made from real ones: that model is built on the device, converted and
        # then sharded; the others on the meta device, sharded, then materialized
        with torch.device(env.device if tc.variant == "nf4-qlora" else "meta"):
            if tc.model == "llama":
                self.mcfg = LLAMA_SMOKE if env.smoke else LLAMA
                model = Llama(self.mcfg)
            else:
                self.mcfg = OVERHEAD_SMOKE if env.smoke else OVERHEAD
                model = ResidualMLP(self.mcfg.dim, self.mcfg.hidden, self.mcfg.n_blocks)
        self.float8 = tc.variant == "float8"
        if self.float8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "output")
        if tc.variant == "nf4-qlora":
            init_weights(model, H.SEED)
            model.to(torch.bfloat16)
            _to_nf4_qlora(model, env.smoke)
            shard_model(model, im.fully_shard, mp, mesh=mesh)
        else:
            shard_model(model, im.fully_shard, mp, mesh=mesh)
            model.to_empty(device=env.device)
            init_weights(model, H.SEED)
        self.model = model
        # foreach=True: what AdamW picks by default on CUDA for both implementations' parameters;
        # on CPU (--smoke) it would take its per-tensor loop, so the smoke run names it.
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=H.LR, foreach=True)
        self.steps = 0
        self.bwd_start: list[int | None] = []  # memory_allocated at each block's backward, this step
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(self._probe(i))

    def _probe(self, i: int):
        def on_grad(grad):
            self.bwd_start[i] = self.env.allocated()

        def hook(module, args, out):
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(on_grad)

        return hook

    def batch(self):
        g = torch.Generator().manual_seed(1_000_003 + self.steps)
        if self.tc.model == "llama":
            c = self.mcfg
            tokens = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g)
            return tokens[:, :-1].to(self.env.device), tokens[:, 1:].to(self.env.device)
        return H.make_batch(self.mcfg.input_shape, 0, self.steps, self.env.device)

    def step(self) -> None:
        x, target = self.batch()
        self.bwd_start = [None] * len(self.model.blocks)
        out = self.model(x)
        if self.tc.model == "llama":
            loss = F.cross_entropy(out.flatten(0, 1).float(), target.flatten())
        else:
            loss = H.loss_fn(out, target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.float8:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
        self.steps += 1


def make_mesh(env: Env):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, (WORLD_SIZE,))


def _collect(env: Env) -> None:
    gc.collect()
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def memory_run(impl: str, tc: TrainConfig, env: Env, mesh) -> dict:
    """One implementation from its own start: bytes relative to memory_allocated() there."""
    _collect(env)
    base = env.allocated()
    requested = lambda: torch.cuda.memory_stats().get("requested_bytes.all.current", 0)  # noqa: E731
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()
        req_base = requested()
    run = Run(impl, tc, env, mesh)
    env.sync()
    res: dict = {"impl": impl, "start_bytes": base}
    if env.cuda:
        res["init_peak"] = torch.cuda.max_memory_allocated() - base
        res["after_init"] = torch.cuda.memory_allocated() - base
    for _ in range(tc.memory_steps):
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        run.step()
        env.sync()
        if env.cuda:
            res["step_peak"] = torch.cuda.max_memory_allocated() - base
            res["between_steps"] = torch.cuda.memory_allocated() - base
            # the same in bytes the tensors asked for (the caching allocator's rounding left out)
            res["step_peak_requested"] = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0) - req_base
            res["between_steps_requested"] = requested() - req_base
            res["block_backward_start"] = [b - base if b is not None else None for b in run.bwd_start]
    del run
    _collect(env)
    if env.cuda:
        res["after_delete"] = torch.cuda.memory_allocated() - base
    return res


def timing(tc: TrainConfig, env: Env, mesh, steps_override: int | None) -> dict:
    runs = [Run(impl, tc, env, mesh) for impl in tc.impls]
    warmup = 1 if env.smoke else tc.warmup
    measured = steps_override or (2 if env.smoke else tc.measured)
    block = min(tc.block, measured)
    for _ in range(warmup):
        for r in runs:
            r.step()
    times: dict[str, list[float]] = {r.impl: [] for r in runs}
    for k in range(-(-measured // block)):
        for r in runs if k % 2 == 0 else runs[::-1]:
            for _ in range(block):
                env.sync()
                t0 = time.perf_counter()
                r.step()
                env.sync()
                times[r.impl].append(time.perf_counter() - t0)
    del runs
    _collect(env)
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    a, b = tc.impls
    return {"impls": list(tc.impls), "times": times, "median_ms": {k: 1e3 * v for k, v in med.items()}, "ratio": med[b] / med[a]}


def train_config(tc: TrainConfig, env: Env, mesh, args) -> dict:
    res: dict = {"config": tc.name, "errors": {}}
    try:
        res["timing"] = timing(tc, env, mesh, args.steps)
    except Exception:
        res["errors"]["timing"] = traceback.format_exc()
        _collect(env)
    res["memory"] = {}
    for impl in tc.impls:
        try:
            res["memory"][impl] = memory_run(impl, tc, env, mesh)
        except Exception:
            res["errors"][f"memory:{impl}"] = traceback.format_exc()
            _collect(env)
    return res


# --------------------------------------------------------------------------------------------
# packing ops


@dataclass
class OpCase:
    name: str
    work: str
    op: object  # () -> None
    floor: object  # () -> None
    nbytes: int  # bytes the op reads plus writes
    floor_nbytes: int


def _rows(shape, rank, world_size):
    rows = -(-shape[0] // world_size)
    lo = min(rank * rows, shape[0])
    return (min(lo + rows, shape[0]) - lo,) + tuple(shape[1:])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def op_cases(work: str, shapes: list[tuple[int, ...]], device) -> list[OpCase]:
    """The packing ops on one unit of `shapes` sharded over WORLD_SIZE ranks (rank RANK), with
    the buffers laid out as fsdp_native lays them out (shards as views into one flat buffer)."""
    from fsdp_native import ops

    f32, bf16 = torch.float32, torch.bfloat16
    ws = WORLD_SIZE
    padded = [ops.padded_shard_numel(s, ws) for s in shapes]
    n_shard, n_full = sum(padded), sum(padded) * ws
    offsets = [sum(padded[:i]) for i in range(len(padded))]
    real = [_numel(_rows(s, RANK, ws)) for s in shapes]
    es = {f32: 4, bf16: 2}
    cases = []

    def randn(n, dtype):
        return torch.randn(n, device=device, dtype=f32).to(dtype)

    def flat_copy(n, src_dt, dst_dt):
        src, dst = randn(n, src_dt), torch.empty(n, device=device, dtype=dst_dt)
        return lambda: dst.copy_(src)

    for src_dt in (f32, bf16):
        flat_shards = randn(n_shard, src_dt)
        shards = [flat_shards[o : o + r] for o, r in zip(offsets, real)]
        ag = torch.empty(n_full, device=device, dtype=bf16)
        mine = ag[RANK * n_shard : (RANK + 1) * n_shard]
        label = "fp32->bf16" if src_dt == f32 else "bf16->bf16"
        cases.append(OpCase(
            f"copy-in {label}", work, lambda s=shards, m=mine: ops.all_gather_copy_in(s, padded, m),
            flat_copy(n_shard, src_dt, bf16), sum(real) * es[src_dt] + n_shard * 2, n_shard * (es[src_dt] + 2)))

    ag = randn(n_full, bf16)
    flat_params = torch.empty(sum(_numel(s) for s in shapes), device=device, dtype=bf16)
    params, o = [], 0
    for s in shapes:
        params.append(flat_params[o : o + _numel(s)].view(s))
        o += _numel(s)
    n_params = flat_params.numel()
    cases.append(OpCase(
        "copy-out bf16", work, lambda: ops.all_gather_copy_out(ag, padded, ws, params),
        flat_copy(n_params, bf16, bf16), n_params * 4, n_params * 4))
    # the same copy the way torch FSDP2 makes it (one split_with_sizes_copy into (world size,
    # padded shard) views of padded unsharded buffers), to time against ours; counted as the
    # same bytes, so the two rows' percentages compare
    ag_rows = ag.view(ws, n_shard)
    torch_outs = [torch.empty(ws, p, device=device, dtype=bf16) for p in padded]
    cases.append(OpCase(
        "copy-out bf16 (torch FSDP2's split_with_sizes_copy)", work,
        lambda: torch.split_with_sizes_copy(ag_rows, padded, dim=1, out=torch_outs),
        flat_copy(n_params, bf16, bf16), n_params * 4, n_params * 4))

    grads = [randn(_numel(s), bf16).view(s) for s in shapes]
    for dst_dt in (bf16, f32):
        rs_in = torch.empty(n_full, device=device, dtype=dst_dt)
        label = "bf16" if dst_dt == bf16 else "bf16->fp32"
        cases.append(OpCase(
            f"rs copy-in {label}", work, lambda r=rs_in: ops.reduce_scatter_copy_in(grads, padded, ws, r),
            flat_copy(n_full, bf16, dst_dt), n_params * 2 + n_full * es[dst_dt], n_full * (2 + es[dst_dt])))
        if dst_dt == bf16 and all(s[0] % ws == 0 for s in shapes):  # torch FSDP2's way: _chunk_cat
            cases.append(OpCase(
                "rs copy-in bf16 (torch FSDP2's _chunk_cat)", work,
                lambda r=rs_in: torch._chunk_cat(grads, dim=0, num_chunks=ws, out=r.view(ws, -1)),
                flat_copy(n_full, bf16, dst_dt), n_params * 2 + n_full * es[dst_dt], n_full * (2 + es[dst_dt])))

    for src_dt, acc in ((f32, False), (bf16, True)):
        out = randn(n_shard, src_dt)
        g = [randn(r, f32) for r in real]
        label = "fp32 /8" if not acc else "bf16->fp32 /8 acc"
        nbytes = n_shard * es[src_dt] + sum(real) * 4 * (2 if acc else 1)
        cases.append(OpCase(
            f"rs copy-out {label}", work,
            lambda o=out, g=g, a=acc: ops.reduce_scatter_copy_out(o, padded, g, divide_factor=8.0, accumulate=a),
            flat_copy(n_shard, src_dt, f32), nbytes, n_shard * (es[src_dt] + 4)))
    return cases


def quant_op_cases(work: str, shapes: list[tuple[int, ...]], device) -> list[OpCase]:
    """fsdp_native's quantized all-gather kernels (Triton on CUDA, C++ on CPU) on rank RANK's bf16
    shards of ``shapes`` over WORLD_SIZE ranks: quantize into the rank's chunk, and dequantize
    the gathered chunks of every rank into bf16 parameters. Floor: one flat uint8 copy that
    reads and writes as many bytes as the op (source plus destination bytes, split evenly), as
    benchmarks/bench_quant.py does on CPU."""
    from fsdp_native import quant as Q

    ws = WORLD_SIZE
    padded = [ops_padded(s) for s in shapes]
    rows = [_numel(s[1:]) for s in shapes]
    shards = [(torch.randn(_numel(_rows(s, RANK, ws)), device=device) * 0.02).to(torch.bfloat16) for s in shapes]
    src_bytes = sum(2 * t.numel() for t in shards)
    cases = []

    def floor_of(nbytes):
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    def add(name, fn, nbytes):
        cases.append(OpCase(name, work, fn, floor_of(nbytes), nbytes, nbytes // 2 * 2))

    for fmt in Q.FORMATS:
        out = torch.empty(Q.unit_layout(padded, rows, fmt).rank_nbytes, dtype=torch.uint8, device=device)
        add(f"quantize {fmt}", lambda o=out, f=fmt: Q.quantize_copy_in(shards, padded, rows, o, format=f), src_bytes + out.numel())
        if fmt == Q.FP8_TENSORWISE:
            amax = torch.empty(len(shards), device=device)
            Q.quantize_amax(shards, amax)
            add("quantize fp8_tensorwise, amax given",
                lambda o=out: Q.quantize_copy_in(shards, padded, rows, o, format=Q.FP8_TENSORWISE, amax=amax), src_bytes + out.numel())
            add("quantize_amax", lambda: Q.quantize_amax(shards, amax), src_bytes)
        Q.quantize_copy_in(shards, padded, rows, out, format=fmt)
        gathered = out.repeat(ws)
        outs = [torch.empty(_numel(s), dtype=torch.bfloat16, device=device) for s in shapes]
        add(f"dequantize {fmt}", lambda g=gathered, o=outs, f=fmt: Q.dequantize_copy_out(g, padded, rows, ws, o, format=f),
            gathered.numel() + sum(2 * o.numel() for o in outs))
    if device.type == "cuda":  # the ops that convert, again with the integer math (FSDP_NATIVE_TRITON_CVT=0)
        Q._import_triton_kernels()
        from fsdp_native.kernels import quant as K

        def integer_math(fn):
            def run():
                was, K.HW_CVT = K.HW_CVT, False
                try:
                    fn()
                finally:
                    K.HW_CVT = was
            return run

        cases += [replace(c, name=c.name + " (integer math)", op=integer_math(c.op))
                  for c in list(cases) if c.name.startswith(("quantize fp8", "dequantize"))]  # fmt: skip
    return cases


def ops_padded(shape) -> int:
    from fsdp_native import ops

    return ops.padded_shard_numel(shape, WORLD_SIZE)


def time_op_case(c: OpCase, env: Env, iters: int, reps: int) -> dict:
    res: dict = {"op": c.name, "work": c.work, "bytes": c.nbytes}
    if env.cuda:
        for kind, ahead in (("device", True), ("host", False)):
            ours = statistics.median(H.time_cuda(c.op, iters, warmup=2, reps=reps, queue_ahead=ahead))
            floor = statistics.median(H.time_cuda(c.floor, iters, warmup=2, reps=reps, queue_ahead=ahead))
            res[kind] = _ratio_cells(ours, floor, c)
    else:
        ours = statistics.median(H.time_cpu(c.op, iters, warmup=1))
        floor = statistics.median(H.time_cpu(c.floor, iters, warmup=1))
        res["host"] = _ratio_cells(ours, floor, c)
    return res


def _ratio_cells(ours: float, floor: float, c: OpCase) -> dict:
    gbs, floor_gbs = c.nbytes / ours / 1e9, c.floor_nbytes / floor / 1e9
    return {"us": ours * 1e6, "floor_us": floor * 1e6, "GBps": gbs, "floor_GBps": floor_gbs, "of_floor": gbs / floor_gbs}


def ops_section(env: Env, args) -> dict:
    if env.smoke:
        works = {"llama8b layer (smoke)": LLAMA_SMOKE.layer_shapes(), "overhead block (smoke)": _block_shapes(OVERHEAD_SMOKE)}
    else:
        works = {"llama8b layer": LLAMA.layer_shapes(), "overhead block": _block_shapes(OVERHEAD)}
    out = {"rows": [], "errors": {}}
    for work, shapes in works.items():
        try:
            for c in op_cases(work, shapes, env.device) + quant_op_cases(work, shapes, env.device):
                small = "overhead" in work
                reps = args.op_reps * (10 if small else 1)
                out["rows"].append(time_op_case(c, env, 3 if env.smoke else args.op_iters, 1 if env.smoke else reps))
        except Exception:
            out["errors"][work] = traceback.format_exc()
    return out


def _block_shapes(cfg) -> list[tuple[int, ...]]:
    d, h = cfg.dim, cfg.hidden
    return [(d,), (d,), (h, d), (h,), (d, h), (d,)]


# --------------------------------------------------------------------------------------------
# report


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def format_report(result: dict) -> str:
    lines = [f"Machine: {H.describe_machine(result['machine'])}; fake process group, world size {WORLD_SIZE}."]
    lines += ["", "| config | A | A ms/step | B | B ms/step | ratio B/A |", "|---|---|---|---|---|---|"]
    for r in result["train"]:
        t, (ia, ib) = r.get("timing"), CONFIGS[r["config"]].impls
        if t:
            m = t["median_ms"]
            lines.append(f"| {r['config']} | {ia} | {m[ia]:.2f} | {ib} | {m[ib]:.2f} | **{t['ratio']:.2f}** |")
        else:
            lines.append(f"| {r['config']} | {ia} | error | {ib} | error | - |")
    lines += ["", "Memory, MiB over each run's start (A / B):", "",
              "| config | step peak | between steps | block backward start (first, last block) | step peak, between steps: requested |",
              "|---|---|---|---|---|"]
    for r in result["train"]:
        mem, (ia, ib) = r.get("memory", {}), CONFIGS[r["config"]].impls
        a, b = mem.get(ia, {}), mem.get(ib, {})

        def pair(key, pick=None):
            va, vb = a.get(key), b.get(key)
            if pick is not None:
                va, vb = (pick(v) if v else None for v in (va, vb))
            return f"{_mib(va)} / {_mib(vb)}"

        bwd = f"{pair('block_backward_start', lambda v: v[0])}, {pair('block_backward_start', lambda v: v[-1])}"
        req = f"{pair('step_peak_requested')}, {pair('between_steps_requested')}"
        lines.append(f"| {r['config']} | {pair('step_peak')} | {pair('between_steps')} | {bwd} | {req} |")
    lines += ["", "Packing ops against the floor (one flat copy of the same numel and dtypes):", "",
              "| work | op | device us | floor us | % of floor (device) | host us | % of floor (host) |", "|---|---|---|---|---|---|---|"]
    for row in result["ops"]["rows"]:
        d, h = row.get("device"), row["host"]
        dcells = f"{d['us']:.1f} | {d['floor_us']:.1f} | {100 * d['of_floor']:.0f}%" if d else "- | - | -"
        lines.append(f"| {row['work']} | {row['op']} | {dcells} | {h['us']:.1f} | {100 * h['of_floor']:.0f}% |")
    errors = [(r["config"], k, v) for r in result["train"] for k, v in r["errors"].items()]
    errors += [("ops", k, v) for k, v in result["ops"]["errors"].items()]
    if errors:
        lines += ["", f"{len(errors)} part(s) failed:"]
        lines += [f"--- {c} {k}:\n{v}" for c, k, v in errors]
    return "\n".join(lines)


def _dump(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _brief(r: dict) -> str:
    """One line of a training config's result, for the log as the run goes."""
    (ia, ib), parts = CONFIGS[r["config"]].impls, []
    t = r.get("timing")
    if t:
        parts.append(f"{ia} {t['median_ms'][ia]:.2f} ms, {ib} {t['median_ms'][ib]:.2f} ms, ratio {t['ratio']:.3f}")
    mem = r.get("memory", {})
    for impl in (ia, ib):
        peak = mem.get(impl, {}).get("step_peak")
        if peak is not None:
            parts.append(f"{impl} peak {peak / 2**20:.0f} MiB")
    if r["errors"]:
        parts.append(f"errors in {sorted(r['errors'])}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, few steps: exercise the code paths")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, help="measured steps per implementation (default: per config)")
    p.add_argument("--op-iters", type=int, default=25, help="timings per packing op (median)")
    p.add_argument("--op-reps", type=int, default=20, help="back-to-back calls per timing (x10 for the small unit)")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-ops", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    if args.smoke:
        env = Env(torch.device("cpu"), smoke=True)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        if not torch.cuda.is_available():
            p.error("no GPU: run with --smoke on a CPU")
        env = Env(torch.device("cuda", torch.cuda.current_device()), smoke=False)
    H.init_fake_process_group(WORLD_SIZE)
    import fsdp_native

    result: dict = {"argv": argv, "machine": H.machine_info(), "smoke": args.smoke, "world_size": WORLD_SIZE,
                    "fsdp_native_with_cuda": bool(getattr(fsdp_native._C, "with_cuda", 0)), "train": [], "ops": {"rows": [], "errors": {}}}
    t_start = time.time()
    if not args.no_train:
        mesh = make_mesh(env)
        for name in args.configs:
            t0 = time.time()
            result["train"].append(train_config(CONFIGS[name], env, mesh, args))
            print(f"  [{name}] {time.time() - t0:.0f}s: {_brief(result['train'][-1])}", file=sys.stderr, flush=True)
            _dump(result, args.json)  # what is done so far survives a run cut short
    if not args.no_ops:
        t0 = time.time()
        result["ops"] = ops_section(env, args)
        print(f"  [packing ops] {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    result["seconds"] = time.time() - t_start
    dist.destroy_process_group()
    print(format_report(result))
    _dump(result, args.json)
    failed = any(r["errors"] for r in result["train"]) or bool(result["ops"]["errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
