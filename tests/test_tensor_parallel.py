"""FSDP composed with tensor parallelism (2-D parallelism), as torch FSDP2 composes them and as
pytorch/examples' ``fsdp_tp_example.py`` and torchtitan run it: one device mesh with dims
("dp", "tp"), ``parallelize_module(model, mesh["tp"], plan)``, then ``fully_shard`` of the
blocks and the root on ``mesh["dp"]``. 4 gloo ranks as 2 x 2.

* **Against torch FSDP2** (same model, plan and data): losses and every rank's local shards bit
  for bit, and the same DTensor placements (``_StridedShard`` where TP shards dim 0 too) and
  global shapes. Two plans: column/row-wise Linears next to a plain (unparallelized) norm in one
  unit; and sequence parallelism, whose replicated norm weights get ``Partial`` gradients that
  must be all-reduced over TP before the data-parallel reduce-scatter (once, after gradient
  accumulation without sync; in fp32 for bf16 compute from torch 2.15). fp32 and bf16 compute
  with fp32 reduction, gradient accumulation without sync, HSDP (a 3-D mesh), torchtitan's
  meta-device flow (parallelize and shard on meta, ``to_empty``, initialise the DTensors), and
  blocks whose layers run twice (bf16, with and without accumulation: torch 2.15 sums such
  gradient contributions in fp32 for replicated TP parameters and in bf16 for sharded ones).
* **pytorch/examples' ``fsdp_tp_example.py``** (its plan on a small Llama: row-wise
  embeddings, sequence-parallel norms, column/row-wise attention and feed-forward, the whole
  model one unit as there, and also a unit per block): losses and local shards bit for bit
  torch FSDP2's. Also as torchtitan trains with TP: bf16 compute, the logits left sharded over
  the vocabulary as the root unit's DTensor output, and the loss under ``loss_parallel()``.
* **Against the unsharded model** on one rank (both data-parallel batches, averaged; SGD, which
  unlike Adam shows a wrong gradient scale): every rank's local shard equals the matching chunk
  of the reference's parameters.
* **Checkpoints across libraries:** DCP saves fsdp_native's sharded state dict and torch FSDP2 +
  TP loads it (and the other way round); the loaded parameters are the saved ones.
* **fsdp_native's own quantized all-gather** (fp8_rowwise, NF4) on TP parameters: the
  unsharded local tensors are the reference's quantized all-gather of the TP-local tensors.
* **Errors:** a DTensor on the data-parallel mesh itself, or on a mesh over the same ranks as
  it; an int reshard_after_forward with TP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from dist_utils import _clear_dtensor_caches, assert_close, load_impl, quantized_unsharded, raises_exactly, ref_impl, run_distributed, run_grid
from models import Attention, ModelArgs, TransformerBlock

DIM, HIDDEN, SEQ, BATCH = 16, 40, 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class ReusedBlock(Block):
    """The block's layers applied twice: TP parameters with two gradient contributions per
    backward, whose sum torch 2.15 makes in bf16 or fp32 by its ``grad_dtype`` rule."""

    def forward(self, x):
        h = x + self.w2(torch.relu(self.w1(self.norm(x))))
        return h + self.w2(torch.relu(self.w1(self.norm(h))))


class Model(nn.Module):
    def __init__(self, n: int = 3, block=Block) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.out = nn.Linear(DIM, 5, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _plan(sp: bool) -> dict:
    if not sp:
        return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    # Sequence parallelism (the norm on sequence shards, as the example's Llama plan).
    return {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def _mesh(hsdp: bool, flat: bool = False):
    """(dp 2, tp 2); with `hsdp`, (rep 1, dp 2, tp 2). With `flat`, as torchtitan and Accelerate
    build it for context parallelism: the data-parallel dim "dp" is dims (dp_shard 1, cp 2)
    flattened."""
    if flat:
        root = init_device_mesh("cpu", (1, 1, 2, 2), mesh_dim_names=("rep", "dp_shard", "cp", "tp"))
        root["dp_shard", "cp"]._flatten("dp")
        return root
    if hsdp:
        return init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("rep", "dp", "tp"))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _build(impl, sp: bool, hsdp: bool, mp: bool, seed: int = 0, raf=True, meta: bool = False, reuse: bool = False,
           flat: bool = False):
    """The model with the TP plan and fully_shard; with `meta`, as torchtitan: built on the meta
    device, parallelized and sharded there, then ``to_empty`` and initialised on the DTensors."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = Model(block=ReusedBlock if reuse else Block)
    mesh = _mesh(hsdp, flat)
    tp, dp = mesh["tp"], mesh["rep", "dp"] if hsdp else mesh["dp"]
    for b in model.blocks:
        parallelize_module(b, tp, _plan(sp))
        if sp:  # the block's input and output as sequence shards; the model's as replicated
            b.register_forward_pre_hook(lambda m, a: (DTensor.from_local(a[0], tp, (Replicate(),)).redistribute(tp, (Shard(1),)),))
            b.register_forward_hook(lambda m, a, out: out.redistribute(tp, (Replicate(),)).to_local())
    kw = dict(mesh=dp, reshard_after_forward=raf)
    if mp:
        kw["mp_policy"] = impl.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    torch.nn.init.normal_(p, std=0.1)
    return model, mesh


def _batches(steps: int, dp_rank: int | None):
    """Per step, the batch of data-parallel rank `dp_rank` (both halves when None)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(2 * BATCH, SEQ, DIM, generator=gen)
        out.append(x if dp_rank is None else x[dp_rank * BATCH : (dp_rank + 1) * BATCH])
    return out


def _opt(params, sgd: bool):
    # SGD against the unsharded model: Adam would hide a wrong gradient scale.
    return torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.AdamW(params, lr=1e-2)


def _train(model, dp_rank: int, steps: int = 3, accum: int = 1, sgd: bool = False) -> list[float]:
    opt = _opt(model.parameters(), sgd)
    losses = []
    for x in _batches(steps, dp_rank):
        for micro, xm in enumerate(x.chunk(accum)):
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)
            loss = model(xm).float().pow(2).mean() / accum
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _locals(model) -> dict:
    return {
        n: (p.to_local().detach().clone(), tuple(p.placements), tuple(p.shape), p.device_mesh.mesh_dim_names)
        for n, p in model.named_parameters()
    }


def _expected_local(full: torch.Tensor, p: DTensor) -> torch.Tensor:
    """The local shard of the full value `full` under `p`'s placements, mesh dim by mesh dim
    (TP first: FSDP chunks what TP left this rank)."""
    local = full
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    for m in reversed(range(mesh.ndim)):
        pl = p.placements[m]
        if isinstance(pl, Shard) or type(pl).__name__ == "_StridedShard":
            local = local.chunk(mesh.size(m), dim=pl.dim)[coord[m]]
    return local


def parity(sp: bool, mp: bool, hsdp: bool = False, accum: int = 1, meta: bool = False, reuse: bool = False,
           flat: bool = False) -> None:
    impl = load_impl()
    what = f"[{impl.name}] sp={sp} mp={mp} hsdp={hsdp} accum={accum} meta={meta} reuse={reuse} flat={flat}"
    got_model, mesh = _build(impl, sp, hsdp, mp, meta=meta, reuse=reuse, flat=flat)
    dp_rank = mesh["dp"].get_local_rank()
    got = _train(got_model, dp_rank, accum=accum)
    ref_model, _ = _build(ref_impl(), sp, hsdp, mp, meta=meta, reuse=reuse, flat=flat)
    ref = _train(ref_model, dp_rank, accum=accum)
    assert_close(f"{what}: losses", got, ref, dict(rtol=0, atol=0))
    a, b = _locals(got_model), _locals(ref_model)
    assert a.keys() == b.keys()
    for n in b:
        assert a[n][1:] == b[n][1:], f"{what}: {n}: placements, shape, mesh dims {a[n][1:]} vs torch's {b[n][1:]}"
        assert_close(f"{what}: {n}", a[n][0], b[n][0], dict(rtol=0, atol=0))
    if not any(type(pl).__name__ == "_StridedShard" for n in a for pl in a[n][1]):
        raise AssertionError(f"{what}: no parameter got a _StridedShard placement")


def parity_grid() -> None:
    configs = [dict(sp=s, mp=m) for s in (False, True) for m in (False, True)]
    more = [dict(sp=False, mp=True, accum=2), dict(sp=True, mp=True, accum=2), dict(sp=True, mp=False, hsdp=True)]
    more.append(dict(sp=True, mp=True, meta=True))
    more += [dict(sp=False, mp=True, reuse=True), dict(sp=True, mp=True, accum=2, reuse=True)]
    more += [dict(sp=True, mp=True, hsdp=True, flat=True), dict(sp=False, mp=True, accum=2, flat=True)]
    run_grid(configs + more, parity, "tp")


def test_tp_matches_torch_fsdp2():
    run_distributed(parity_grid, 4)


class MathAttention(Attention):
    """models.Attention with the attention written out on the local heads (DTensor has no
    sharding rule for the CPU's fused scaled_dot_product_attention, and torch 2.11's cannot
    shard the batched matmul over heads)."""

    def forward(self, x):
        bsz, seq, _ = x.shape
        q, k, v = (w(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        dt = isinstance(q, DTensor)
        if dt:  # heads sharded over TP: each rank attends over its own
            mesh, placements = q.device_mesh, q.placements
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5 + torch.full((seq, seq), float("-inf"), dtype=q.dtype).triu(1)
        out = torch.softmax(scores, dim=-1) @ v
        if dt:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seq, -1))


class Llama(nn.Module):
    """The example's model, small: token embeddings, pre-norm blocks, a norm and the output."""

    def __init__(self, args) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        for layer in self.layers:
            layer.attention.__class__ = MathAttention
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _example_run(impl, per_block: bool, loss_par: bool = False) -> dict:
    """pytorch/examples' fsdp_tp_example.py: its device mesh, its TP/SP plan (the attention's
    second input, freqs_cis, left out), ``fully_shard(model, mesh=dp_mesh)``, AdamW with
    foreach, ``output.sum().backward()`` on tokens seeded by step and dp rank; plus
    ``clip_grad_norm_`` (whose norm is recorded with the losses).

    With `loss_par`, as torchtitan trains with TP: bf16 compute with fp32 reduction, the output
    layer's logits left as a DTensor sharded over the vocabulary (the root unit's output), and
    the cross-entropy computed on those shards under ``loss_parallel()``."""
    args = ModelArgs(n_layers=2, vocab_size=64, dim=32, n_heads=4)
    # Each library's run with DTensor's caches cleared: they span runs, and on torch 2.9 the row-wise
    # embedding's mask placement of the other library's run (whose op specs differ: torch 2.9's
    # FSDP2 leaves the unsharded bf16 parameter's spec saying fp32) broke this one's reduction.
    _clear_dtensor_caches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    torch.manual_seed(0)
    model = Llama(args)
    kw = dict(mp_policy=impl.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if loss_par else {}
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_par else Replicate(),
                                      use_local_output=not loss_par),
        },
    )
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, plan)
        if per_block:
            impl.fully_shard(block, mesh=dp_mesh, **kw)
    impl.fully_shard(model, mesh=dp_mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    losses = []
    for i in range(3):
        torch.manual_seed(i + dp_mesh.get_local_rank())
        tokens = torch.randint(args.vocab_size, (4, 17))
        out = model(tokens[:, :-1])
        if loss_par:
            assert isinstance(out, DTensor) and out.placements == (Shard(2),), f"logits: {type(out)} {getattr(out, 'placements', '')}"
            with loss_parallel():
                loss = F.cross_entropy(out.flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
        else:
            loss = out.sum()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # every parameter on the 2-D mesh
        losses.append(norm.full_tensor().item())
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return dict(losses=losses, locals=_locals(model))


def example_flow(per_block: bool, loss_par: bool = False) -> None:
    impl = load_impl()
    got, ref = _example_run(impl, per_block, loss_par), _example_run(ref_impl(), per_block, loss_par)
    what = f"[{impl.name}] fsdp_tp_example per_block={per_block} loss_parallel={loss_par}"
    assert_close(f"{what}: losses", got["losses"], ref["losses"], dict(rtol=0, atol=0))
    for n, (t, *meta) in ref["locals"].items():
        assert got["locals"][n][1:] == tuple(meta), f"{what}: {n}: {got['locals'][n][1:]} vs torch's {tuple(meta)}"
        assert_close(f"{what}: {n}", got["locals"][n][0], t, dict(rtol=0, atol=0))


def example_grid() -> None:
    run_grid([dict(per_block=False), dict(per_block=True), dict(per_block=True, loss_par=True)], example_flow, "example")


def test_fsdp_tp_example_flow_matches_torch_fsdp2():
    run_distributed(example_grid, 4)


def reference() -> None:
    """fsdp_native + TP against the unsharded model trained on both batches at once (SGD)."""
    impl = load_impl()
    model, mesh = _build(impl, True, False, False)
    _train(model, mesh.get_local_rank("dp"), sgd=True)
    torch.manual_seed(0)
    ref = Model()
    opt = _opt(ref.parameters(), True)
    for x in _batches(3, None):
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert_close(f"[{impl.name}] {n}", p.to_local(), _expected_local(full[n].detach(), p), dict(rtol=1e-5, atol=1e-6))


def test_tp_matches_unsharded_training():
    run_distributed(reference, 4)


def _save_load(save_impl, load_impl_, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model, _ = _build(save_impl, False, False, False, seed=1)
    _train(model, dist.get_rank() // 2, steps=1)
    saved = _locals(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    other, _ = _build(load_impl_, False, False, False, seed=2)
    sd = {"model": other.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd["model"])
    got = _locals(other)
    for n in saved:
        assert got[n][1:] == saved[n][1:], f"{n}: {got[n][1:]} vs {saved[n][1:]}"
        assert_close(f"{save_impl.name} -> {load_impl_.name}: {n}", got[n][0], saved[n][0], dict(rtol=0, atol=0))


def checkpoints(tmp: str) -> None:
    impl, ref = load_impl(), ref_impl()
    _save_load(impl, ref, f"{tmp}/a")
    _save_load(ref, impl, f"{tmp}/b")


def test_tp_checkpoints_load_across_libraries(tmp_path):
    run_distributed(checkpoints, 4, str(tmp_path))


def quantized(fmt: str) -> None:
    """fsdp_native's own quantized all-gather on TP parameters quantizes their TP-local tensors:
    each unsharded local tensor is the reference's quantized all-gather of the TP-local tensor
    over the data-parallel ranks (bf16 compute), and a step trains."""
    impl = load_impl()
    if impl.name != "fsdp_native":
        return
    from fsdp_native import QuantizedAllGather

    torch.manual_seed(0)
    model = Model()
    mesh = _mesh(False)
    locals_ = {}
    for i, b in enumerate(model.blocks):
        parallelize_module(b, mesh["tp"], _plan(False))
        locals_.update({f"blocks.{i}.{n}": p.to_local().detach().clone() for n, p in b.named_parameters() if isinstance(p, DTensor)})
        for p in b.parameters():
            p.requires_grad_(fmt != "nf4")  # NF4 gathers frozen weights only
        policy = impl.mp(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        impl.fully_shard(b, mesh=mesh["dp"], all_gather=QuantizedAllGather(fmt, min_numel=16), mp_policy=policy)
    block = model.blocks[1]
    block.unshard()
    for n in ("w1.weight", "w2.weight"):
        got = dict(block.named_parameters())[n]
        assert isinstance(got, DTensor) and got.dtype == torch.bfloat16, (n, type(got), got.dtype)
        want = quantized_unsharded(locals_[f"blocks.1.{n}"], fmt, 2)
        assert_close(f"[{fmt}] blocks.1.{n}", got.to_local(), want, dict(rtol=0, atol=0))
    block.reshard()
    impl.fully_shard(model, mesh=mesh["dp"])
    _train(model, mesh.get_local_rank("dp"), steps=1)


def test_tp_with_quantized_all_gather():
    run_distributed(_quantized_grid, 4)


def _quantized_grid() -> None:
    run_grid([dict(fmt="fp8_rowwise"), dict(fmt="nf4")], quantized, "tp-quant")


def errors() -> None:
    impl = load_impl()
    if impl.name != "fsdp_native":
        return
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    model = Model()
    parallelize_module(model.blocks[0], mesh["tp"], _plan(False))
    raises_exactly(
        NotImplementedError,
        f"fully_shard: parameter 'w1.weight' is a DTensor on mesh {mesh['tp']}: an int reshard_after_forward (resharding to "
        "a smaller mesh after forward) is not supported for tensor-parallel parameters, as in torch FSDP2; pass a bool",
        lambda: impl.fully_shard(model.blocks[0], mesh=mesh["dp"], reshard_after_forward=2),
    )
    # A "TP" mesh over the data-parallel ranks themselves does not compose (the error's middle
    # is torch's own text).
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mesh22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    lin = nn.Linear(4, 4)
    parallelize_module(lin, other["a"], ColwiseParallel())
    try:
        impl.fully_shard(lin, mesh=mesh22["dp"])
    except ValueError as e:
        want = (
            f"fully_shard: parameter 'weight' is a DTensor on mesh {other['a']} that does not compose with the "
            f"data-parallel mesh {mesh22['dp']}: "
        )
        assert str(e).startswith(want) and str(e).endswith(
            "; expected the TP mesh and the data-parallel mesh to be distinct dims of one device mesh (a parameter "
            "sharded by another fully_shard cannot be sharded again)"
        ), str(e)
    else:
        raise AssertionError("a TP mesh over the data-parallel ranks was accepted")
    dp = mesh["dp"]
    bad = nn.Linear(4, 4)
    bad.weight = nn.Parameter(distribute_tensor(bad.weight.detach(), dp, (Shard(0),)))
    raises_exactly(
        ValueError,
        "fully_shard: argument 'module' (Linear) has parameter 'weight' of Linear that is already a DTensor (placements "
        "(Shard(dim=0),)) on the data-parallel mesh, e.g. sharded by torch's fully_shard; fsdp_native composes with "
        "DTensors of tensor parallelism on another named dim of the data-parallel mesh's device mesh only",
        lambda: impl.fully_shard(bad, mesh=dp),
    )


def test_tp_errors():
    run_distributed(errors, 4)
