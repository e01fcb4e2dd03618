"""fsdp_native's own quantized all-gather (``fully_shard(..., all_gather=QuantizedAllGather(fmt))``).

* The unsharded parameters the forward computes with are exactly what the plain-PyTorch
  reference (``fsdp_native._quant_ref``) gives for quantizing every rank's padded shard and
  dequantizing the gathered chunks, bit for bit; small and 1-D parameters are gathered
  unquantized and equal the full-precision ones.
* The all-gather moves the quantized bytes (``record_trace``): fp8 at most 0.52x and NF4 at
  most 0.30x the bf16 bytes of the quantized parameters, scales included.
* Training with an fp8 all-gather follows the bf16 all-gather's losses within a stated
  tolerance; NF4 on frozen weights with trainable adapters too.
* Training with it is torch FSDP2's training on the reference's quantized weights (a hook
  puts them in place after torch's bf16 all-gather), losses and parameters bit for bit,
  every format, at world size 2 (with the backward's all-gather quantized again or not) and
  HSDP 2x2: the gradients of the dequantized parameters reach the full-precision shards as
  torch's do.
* A unit of several dtypes with no param_dtype (bf16 weight and bias, fp32 norm and adapters,
  odd sizes) gathers the quantized parameters (each dequantized into its own dtype) and the
  others as bytes, bit for bit as the reference, and trains.
* CPU offload and an int reshard_after_forward give the same numbers as without them.
* Activation checkpointing (with gradient accumulation) gives the same numbers as without.
* Blocks compiled before fully_shard see the same dequantized parameters and are not
  recompiled after the first step.
* Bad policies raise clear errors.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import load_impl, run_distributed, run_grid
from models import ModelArgs, Transformer, lm_loss

pytestmark = pytest.mark.skipif(load_impl().name != "fsdp_native", reason="fsdp_native's own feature")

ARGS = ModelArgs(n_layers=2, dim=64, vocab_size=128, max_seq_len=16, n_heads=4)
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(
    fmt: str | None,
    mesh,
    frozen_blocks: bool = False,
    seed: int = 0,
    args: ModelArgs = ARGS,
    compile_blocks: bool = False,
    ac: bool = False,
    **shard_kw,
):
    import fsdp_native

    torch.manual_seed(seed)
    model = Transformer(args)
    if frozen_blocks:  # NF4: frozen base weights, trainable norms and head
        for layer in model.layers:
            for name, p in layer.named_parameters():
                if p.dim() >= 2:
                    p.requires_grad_(False)
    if ac:  # activation checkpointing of every block
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    mp = fsdp_native.MixedPrecisionPolicy(**BF16)
    ag = None if fmt is None else fsdp_native.QuantizedAllGather(fmt, min_numel=256)
    for layer in model.layers:
        if compile_blocks:  # torchtitan's order: compiled, then sharded
            layer.compile()
        fsdp_native.fully_shard(layer, mesh=mesh, mp_policy=mp, all_gather=ag, **shard_kw)
    fsdp_native.fully_shard(model, mesh=mesh, mp_policy=mp, **shard_kw)
    return model


def _check_values(fmt: str) -> None:
    from dist_utils import full, quantized_unsharded

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    model = _build(fmt, mesh, frozen_blocks=fmt == "nf4")
    block = model.layers[0]
    names = [n for n, _ in block.named_parameters()]
    fulls = {n: full(p) for n, p in block.named_parameters()}
    seen = {}
    block.register_forward_pre_hook(lambda m, a: seen.update({n: p.detach().clone() for n, p in m.named_parameters()}))
    model(torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len)))
    for n in names:
        w = fulls[n]
        if w.dim() >= 2 and w.numel() >= 256:
            want = quantized_unsharded(w, fmt, ws)
        else:
            want = w.to(torch.bfloat16)
        got = seen[n]
        assert got.dtype == torch.bfloat16 and got.shape == w.shape, (n, got.dtype, got.shape)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{fmt}: unsharded {n!r} differs from the reference"


def _values_grid():
    run_grid([dict(fmt=f) for f in ("fp8_rowwise", "fp8_tensorwise", "nf4")], _check_values, name="quant-values")


def test_quantized_values_match_reference_world_size_2():
    run_distributed(_values_grid, 2)


def _check_bytes(fmt: str, limit: float) -> None:
    import fsdp_native

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    # Rows of 256 elements: a row-wise fp32 scale costs 4 / 512 of the bf16 bytes.
    args = ModelArgs(n_layers=1, dim=256, vocab_size=64, max_seq_len=8, n_heads=4)
    model = _build(fmt, mesh, frozen_blocks=fmt == "nf4", args=args)
    ref = _build(None, mesh, frozen_blocks=fmt == "nf4", args=args)
    x = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    summaries = []
    for m in (model, ref):
        with torch.no_grad(), fsdp_native.record_trace() as rec:
            m(x)
        summaries.append(rec.bytes_summary()[0]["layers.0"]["all_gather"])
    got, bf16 = summaries
    block = model.layers[0]
    small = sum(ops_padded(p) * 2 * ws for p in block.parameters() if p.dim() < 2 or p.numel() < 256)
    ratio = (got - small) / (bf16 - small)
    assert ratio <= limit, f"{fmt}: quantized parameters gathered {ratio:.3f}x their bf16 bytes, expected <= {limit}"


def ops_padded(p) -> int:
    from fsdp_native import ops

    return ops.padded_shard_numel(p.shape, dist.get_world_size())


def _bytes_grid():
    run_grid([dict(fmt="fp8_rowwise", limit=0.52), dict(fmt="fp8_tensorwise", limit=0.52), dict(fmt="nf4", limit=0.30)], _check_bytes, name="quant-bytes")


def test_quantized_all_gather_bytes():
    run_distributed(_bytes_grid, 2)


def _train(fmt, steps: int, frozen: bool, compile_blocks: bool = False, seen: list | None = None) -> list[float]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,))
    model = _build(fmt, mesh, frozen_blocks=frozen, compile_blocks=compile_blocks)
    if seen is not None:  # the unsharded parameters of layers.0 at each forward (not traced)
        hook = torch._dynamo.disable(lambda m, a: seen.append([p.detach().clone() for p in m.parameters()]))
        model.layers[0].register_forward_pre_hook(hook)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for step in range(steps):  # a copy task: predict the input token
        if compile_blocks and step == 1:
            assert counters["stats"]["unique_graphs"] >= 1, f"{fmt}: nothing was compiled: {dict(counters['stats'])}"
            counters.clear()
        x = torch.randint(0, ARGS.vocab_size, (4 * ws, ARGS.max_seq_len), generator=gen)
        y = x
        loss = lm_loss(model(x[rank * 4 : (rank + 1) * 4]).float(), y[rank * 4 : (rank + 1) * 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if compile_blocks:
        assert counters["stats"]["unique_graphs"] == 0, f"{fmt}: recompiled after the first step: {dict(counters['stats'])}"
    return losses


def _check_training(fmt: str, frozen: bool, tol: float) -> None:
    steps = 40
    ref = _train(None, steps, frozen)
    got = _train(fmt, steps, frozen)
    assert ref[-1] < ref[0] - 0.3, f"the bf16 run did not learn: {ref[0]:.3f} -> {ref[-1]:.3f}"
    worst = max(abs(a - b) for a, b in zip(got, ref))
    assert worst <= tol, f"{fmt}: losses differ from the bf16 all-gather's by up to {worst:.4f} (tolerance {tol})"


def _training_grid():
    run_grid(
        [dict(fmt="fp8_rowwise", frozen=False, tol=0.05), dict(fmt="fp8_tensorwise", frozen=False, tol=0.05), dict(fmt="nf4", frozen=True, tol=0.15)],
        _check_training,
        name="quant-train",
    )


def test_quantized_training_follows_bf16():
    run_distributed(_training_grid, 2)


def _train_against_torch(fmt: str, on_torch: bool, steps: int, hsdp: bool, reshard: bool) -> tuple[list[float], dict]:
    """fsdp_native with the quantized all-gather of format ``fmt`` (``reshard``: the blocks'
    unsharded parameters freed after the forward, so the backward gathers and quantizes them
    again), or (``on_torch``) torch FSDP2 with bf16 all-gathers, each block's quantizable
    weights replaced after each of its all-gathers by the reference's values for this step
    (``dist_utils.torch_quantized_values``; the blocks keep their unsharded parameters to the
    backward). The same model, data and optimizer otherwise. NF4: the blocks' weights frozen.
    ``hsdp``: a (2, 2) mesh, shards over 2 ranks."""
    from dist_utils import full_params, ref_impl, torch_quantized_values

    ws, rank = dist.get_world_size(), dist.get_rank()
    if hsdp:
        mesh, shard_ws = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")), ws // 2
    else:
        mesh, shard_ws = init_device_mesh("cpu", (ws,)), ws
    torch.manual_seed(0)
    model = Transformer(ARGS)
    if fmt == "nf4":
        for layer in model.layers:
            for p in layer.parameters():
                p.requires_grad_(p.dim() < 2)
    impl = ref_impl() if on_torch else load_impl()
    mp = impl.MixedPrecisionPolicy(**BF16)
    kw = {} if on_torch else dict(all_gather=impl.module.QuantizedAllGather(fmt, min_numel=256))
    for layer in model.layers:
        impl.fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not on_torch, **kw)
    impl.fully_shard(model, mesh=mesh, mp_policy=mp)
    if on_torch:  # the quantizing codec's rule
        refresh = torch_quantized_values(
            model.layers, fmt, shard_ws, lambda p: p.dim() >= 2 and p.numel() >= 256 and not (fmt == "nf4" and p.requires_grad)
        )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        if on_torch:  # the step's values, from the sharded full-precision parameters
            assert refresh(), "no parameter to replace: the torch run would be plain bf16"
        x = torch.randint(0, ARGS.vocab_size, (4 * ws, ARGS.max_seq_len), generator=gen)
        loss = lm_loss(model(x[rank * 4 : (rank + 1) * 4]).float(), x[rank * 4 : (rank + 1) * 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model)


def _check_against_torch(fmt: str, hsdp: bool = False, reshard: bool = False) -> None:
    """Training with the quantized all-gather is torch FSDP2's training on the reference's
    quantized-then-dequantized weights, bit for bit: the same forward values, and each
    gradient of a dequantized parameter reduced into its full-precision shard as torch reduces
    the gradient of its bf16 one."""
    steps = 4
    ref_losses, ref_params = _train_against_torch(fmt, True, steps, hsdp, False)
    losses, params = _train_against_torch(fmt, False, steps, hsdp, reshard)
    assert losses == ref_losses, f"{fmt}: losses {losses} differ from torch FSDP2's on the reference weights {ref_losses}"
    for n, v in ref_params.items():
        assert torch.equal(params[n], v), f"{fmt}: parameter {n!r} after {steps} steps differs from torch FSDP2's"


def _against_torch_grid():
    cfgs = [dict(fmt=f) for f in ("fp8_rowwise", "fp8_tensorwise", "nf4")] + [dict(fmt="fp8_rowwise", reshard=True)]
    run_grid(cfgs, _check_against_torch, name="quant-vs-torch")


def _against_torch_hsdp_grid():
    run_grid([dict(fmt=f, hsdp=True, reshard=True) for f in ("fp8_tensorwise", "nf4")], _check_against_torch, name="quant-vs-torch-hsdp")


def test_quantized_training_is_torch_fsdp2_on_the_reference_weights():
    run_distributed(_against_torch_grid, 2)


def test_quantized_training_is_torch_fsdp2_on_the_reference_weights_hsdp_2x2():
    run_distributed(_against_torch_hsdp_grid, 4)


def _check_compiled(fmt: str) -> None:
    """Blocks compiled before fully_shard (torchtitan, torchtune): the compiled forward gets
    the same dequantized parameters as the eager one, is not recompiled after the first step,
    and trains as the eager run does (inductor's fused bf16 arithmetic differs in rounding)."""
    counters.clear()
    seen_eager, seen_compiled = [], []
    eager = _train(fmt, 3, fmt == "nf4", seen=seen_eager)
    compiled = _train(fmt, 3, fmt == "nf4", compile_blocks=True, seen=seen_compiled)
    assert len(seen_eager) == len(seen_compiled) == 3 and len(seen_compiled[0]) == len(seen_eager[0]) > 0
    for a, b in zip(seen_eager[0], seen_compiled[0]):
        assert torch.equal(a, b), f"{fmt}: the compiled block's first unsharded parameters differ from the eager one's"
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    assert worst <= 1e-2, f"{fmt}: compiled losses {compiled} differ from eager {eager} by {worst:.2e} relative"


def _compiled_grid():
    run_grid([dict(fmt="fp8_rowwise"), dict(fmt="nf4")], _check_compiled, name="quant-compile")


def test_quantized_all_gather_with_compiled_blocks():
    run_distributed(_compiled_grid, 2)


def _train_ac(fmt: str, ac: bool) -> tuple[list[float], dict]:
    """3 steps of 2 micro-batches (the first without gradient sync), blocks under activation
    checkpointing or not."""
    from dist_utils import full

    model = _build(fmt, init_device_mesh("cpu", (dist.get_world_size(),)), frozen_blocks=fmt == "nf4", ac=ac)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=gen)
            loss = lm_loss(model(x).float(), x)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {n.replace("_checkpoint_wrapped_module.", ""): full(p) for n, p in model.named_parameters()}


def _check_ac(fmt: str) -> None:
    """The recomputed forward re-gathers and re-quantizes the same shards: activation
    checkpointing changes nothing, bit for bit, with gradient accumulation too."""
    want, got = _train_ac(fmt, ac=False), _train_ac(fmt, ac=True)
    assert got[0] == want[0], f"{fmt}: losses with activation checkpointing {got[0]} differ from {want[0]}"
    for n, v in want[1].items():
        assert torch.equal(got[1][n], v), f"{fmt}: parameter {n!r} differs with activation checkpointing"


def _ac_grid():
    run_grid([dict(fmt=f) for f in ("fp8_rowwise", "fp8_tensorwise", "nf4")], _check_ac, name="quant-ac")


def test_quantized_all_gather_with_activation_checkpointing_and_accumulation():
    run_distributed(_ac_grid, 2)


class _MixedBlock(nn.Module):
    """bf16 weight (quantized; frozen for NF4) beside fp32 norm and low-rank adapters, odd
    sizes: a unit of several dtypes gathered without a param_dtype."""

    def __init__(self, dim: int = 62, out: int = 94, rank: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w = nn.Linear(dim, out).to(torch.bfloat16)  # its bias: 94 bytes per rank, so the chunk needs tail padding
        self.a = nn.Linear(dim, rank, bias=False)
        self.b = nn.Linear(rank, out, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.w(h.to(torch.bfloat16)).float() + self.b(self.a(h))


def _check_mixed_dtypes(fmt: str) -> None:
    import fsdp_native
    from fsdp_native import _quant_ref, ops
    from dist_utils import full

    ws = dist.get_world_size()
    torch.manual_seed(0)
    block = _MixedBlock()
    if fmt == "nf4":
        block.w.requires_grad_(False)
    mp = fsdp_native.MixedPrecisionPolicy(reduce_dtype=torch.float32)  # each parameter's own dtype
    fsdp_native.fully_shard(block, mesh=init_device_mesh("cpu", (ws,)), mp_policy=mp, all_gather=fsdp_native.QuantizedAllGather(fmt, min_numel=256))
    fulls = {n: full(p) for n, p in block.named_parameters()}
    seen = {}
    block.register_forward_pre_hook(lambda m, a: seen.update({n: p.detach().clone() for n, p in m.named_parameters()}))
    opt = torch.optim.AdamW([p for p in block.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, target = torch.randn(8, 62, generator=gen), torch.randn(8, 94, generator=gen)
    losses = []
    for step in range(8):
        loss = (block(x) - target).pow(2).mean()
        if step == 0:
            for n, w in fulls.items():
                # Quantized: 2-D, at least min_numel elements, frozen for NF4 (the bf16 w; for
                # fp8 also the fp32 adapter b), each dequantized into its own dtype.
                if w.dim() == 2 and w.numel() >= 256 and (fmt != "nf4" or n == "w.weight"):
                    padded, row = ops.padded_shard_numel(w.shape, ws), w.shape[1]
                    flat = w.reshape(-1)
                    chunks = [_quant_ref.quantize([flat[r * padded : (r + 1) * padded]], [padded], [row], fmt) for r in range(ws)]
                    want = _quant_ref.dequantize(torch.cat(chunks), [padded], [row], ws, fmt, [w.numel()], [w.dtype])[0].view(w.shape)
                    assert not torch.equal(want, w), n  # the check would not notice a missing quantization
                else:
                    want = w
                got = seen[n]
                assert got.dtype == want.dtype and torch.equal(got, want), f"{fmt}: unsharded {n!r} ({got.dtype}) differs from the reference"
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], f"{fmt}: the mixed-dtype unit did not train: {losses}"


def _mixed_grid():
    run_grid([dict(fmt=f) for f in ("fp8_rowwise", "fp8_tensorwise", "nf4")], _check_mixed_dtypes, name="quant-mixed-dtypes")


def test_quantized_all_gather_in_a_unit_of_several_dtypes():
    run_distributed(_mixed_grid, 2)


def _train_with(fmt: str, steps: int = 3, **shard_kw) -> tuple[list[float], dict, set]:
    """Losses, full parameters and the group sizes of layers.0's all-gathers."""
    import fsdp_native
    from dist_utils import full

    ws, rank = dist.get_world_size(), dist.get_rank()
    model = _build(fmt, init_device_mesh("cpu", (ws,)), frozen_blocks=fmt == "nf4", **shard_kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    losses = []
    with fsdp_native.record_trace() as rec:
        for _ in range(steps):
            x = torch.randint(0, ARGS.vocab_size, (4 * ws, ARGS.max_seq_len), generator=gen)[rank * 4 : (rank + 1) * 4]
            loss = lm_loss(model(x).float(), x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    groups = {s.args.get("group_size", ws) for s in rec.spans if s.lane == "all_gather" and s.unit == "layers.0"}
    return losses, {n: full(p) for n, p in model.named_parameters()}, groups


def _check_policies(fmt: str) -> None:
    """CPU offload and an int reshard_after_forward change where the shards live and which
    group the backward gathers in, not the numbers: the same quantized bytes are dequantized
    (the backward re-gathers the forward's quantized chunks within the smaller group)."""
    import fsdp_native

    ws = dist.get_world_size()
    ref_losses, ref_params, ref_groups = _train_with(fmt)
    assert ref_groups == {ws}, ref_groups
    variants = {
        "CPUOffloadPolicy": (dict(offload_policy=fsdp_native.CPUOffloadPolicy(pin_memory=False)), {ws}),
        "reshard_after_forward=2": (dict(reshard_after_forward=2), {ws, 2}),
    }
    for name, (kw, groups) in variants.items():
        losses, params, got_groups = _train_with(fmt, **kw)
        assert losses == ref_losses, f"{fmt} with {name}: losses {losses}, expected {ref_losses}"
        for n, v in ref_params.items():
            assert torch.equal(params[n], v), f"{fmt} with {name}: parameter {n!r} differs"
        assert got_groups == groups, f"{fmt} with {name}: layers.0 gathered in groups of {sorted(got_groups)}, expected {sorted(groups)}"


def _policies_grid():
    run_grid([dict(fmt=f) for f in ("fp8_rowwise", "nf4")], _check_policies, name="quant-policies")


def test_quantized_all_gather_with_offload_and_int_reshard_after_forward():
    run_distributed(_policies_grid, 4, timeout=360)


def _errors() -> None:
    import fsdp_native

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def expect(exc, text, fn):
        with pytest.raises(exc) as info:
            fn()
        assert str(info.value) == text, str(info.value)

    expect(
        ValueError,
        "fully_shard: argument 'all_gather.format' is 'int8', expected one of 'fp8_tensorwise', 'fp8_rowwise', 'nf4'",
        lambda: fsdp_native.fully_shard(nn.Linear(4, 4), mesh=mesh, all_gather=fsdp_native.QuantizedAllGather("int8")),
    )
    expect(
        TypeError,
        "fully_shard: argument 'all_gather' must be a QuantizedAllGather or None, got str",
        lambda: fsdp_native.fully_shard(nn.Linear(4, 4), mesh=mesh, all_gather="fp8"),
    )
    expect(
        ValueError,
        "fully_shard: argument 'all_gather.block_size' is 48, expected a power of two from 2 to 4096",
        lambda: fsdp_native.fully_shard(nn.Linear(4, 4), mesh=mesh, all_gather=fsdp_native.QuantizedAllGather("nf4", block_size=48)),
    )
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64).to(torch.bfloat16))
    keep_norm = fsdp_native.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: p.dtype if p.dim() == 1 else None
    )
    expect(
        NotImplementedError,
        "fully_shard: argument 'all_gather' (fp8_rowwise) with several unsharded dtypes in a unit needs them to be the "
        "parameters' own, got casts from ['torch.bfloat16', 'torch.float32'] to ['torch.bfloat16', 'torch.float32'] "
        "(mp_policy.param_dtype_override_fn); set mp_policy.param_dtype for all, or none",
        lambda: fsdp_native.fully_shard(m, mesh=mesh, mp_policy=keep_norm, all_gather=fsdp_native.QuantizedAllGather("fp8_rowwise")),
    )
    expect(
        ValueError,
        "fully_shard: argument 'all_gather' (nf4) quantizes float32, bfloat16 and float16 parameters; parameter "
        "'weight' of Linear is torch.float64 (unsharded torch.float64)",
        lambda: fsdp_native.fully_shard(
            nn.Linear(64, 64).double().requires_grad_(False), mesh=mesh, all_gather=fsdp_native.QuantizedAllGather("nf4")
        ),
    )


    # A parameter gathered in NF4 (frozen at fully_shard) made trainable afterwards: raised at
    # the next unshard, on every rank, instead of training through the NF4 values.
    m = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64))
    m.requires_grad_(False)
    fsdp_native.fully_shard(m[0], mesh=mesh, all_gather=fsdp_native.QuantizedAllGather("nf4"))
    fsdp_native.fully_shard(m, mesh=mesh)
    m(torch.randn(2, 64)).sum()
    m[0].weight.requires_grad_(True)
    expect(
        ValueError,
        "fsdp_native: parameter 'weight' of FSDPLinear (unit '0') was frozen at fully_shard and is gathered in NF4 "
        "(all_gather=QuantizedAllGather('nf4')), which has no gradient path, but now requires grad; freeze it "
        "again, or call fully_shard after setting requires_grad",
        lambda: m(torch.randn(2, 64)),
    )
    m[0].weight.requires_grad_(False)
    m[0].reshard()
    m[1].weight.requires_grad_(True)  # unquantized parameters may change
    m(torch.randn(2, 64)).sum().backward()
    assert m[1].weight.grad is not None and m[0].weight.grad is None


def test_quantized_all_gather_errors():
    run_distributed(_errors, 2)


def test_unwritten_all_gather_output_reads_as_zeros(monkeypatch):
    """torch's fake process group (benchmarks) or any all-gather that leaves the other ranks'
    chunks unwritten: they must dequantize to zeros, not to garbage codes times garbage scales
    taken as valid. The collective is replaced by one that writes nothing."""
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's own quantized all-gather")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_native
    from fsdp_native import _comm

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        monkeypatch.setattr(_comm, "all_gather", lambda out, inp, group, rank, size: None)
        for fmt in ("fp8_rowwise", "fp8_tensorwise"):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
            # Garbage where the other rank's chunk will be: freed memory is often reused.
            junk = torch.full((1 << 16,), float("nan"))
            del junk
            fsdp_native.fully_shard(m, all_gather=fsdp_native.QuantizedAllGather(fmt))
            m.unshard()
            for lin, rows in ((m[0], 128), (m[1], 64)):
                w = lin.weight.detach()
                assert torch.equal(w[rows // 2 :], torch.zeros_like(w[rows // 2 :])), (fmt, w[rows // 2 :])
                assert torch.isfinite(w[: rows // 2]).all() and (w[: rows // 2] != 0).any(), fmt
            m.reshard()
    finally:
        dist.destroy_process_group()
