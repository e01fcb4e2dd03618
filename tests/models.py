"""Small test models, shaped like the PyTorch FSDP2 tutorial's transformer.

Token + position embeddings, ``n_layers`` blocks of (LayerNorm, causal
attention, LayerNorm, MLP), final norm and output projection.  Options cover
the feature grid of the parity tests (tied weights, activation checkpointing,
a block called twice per forward, frozen parameters, odd sizes so that dim 0
is not divisible by the world size, a parameter with fewer rows than ranks).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from dist_utils import full, full_params


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    hidden_dim: int | None = None  # default 4 * dim
    weight_tying: bool = False
    checkpoint_activations: bool = False
    # Forward runs layers[0] twice (the block is an FSDP unit called twice).
    repeat_first_layer: bool = False
    # A (3,)-shaped gain: fewer rows than a world size of 4 (empty shards).
    tiny_param: bool = False


# Sizes whose dim 0 is divisible by 2 and 4.
EVEN = ModelArgs()
# Odd sizes: vocab, max_seq_len, hidden_dim (and so every bias of w1) are odd,
# so dim 0 of most parameters is not divisible by the world size.
ODD = ModelArgs(vocab_size=67, max_seq_len=13, dim=30, n_heads=3, hidden_dim=91, tiny_param=True)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bsz, seq, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim or 4 * args.dim)
        self.checkpoint_activations = args.checkpoint_activations

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tiny_param:
            self.gain = nn.Parameter(torch.ones(3))
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, seq = tokens.shape
        pos = torch.arange(seq, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        layers = list(self.layers)
        if self.args.repeat_first_layer:
            layers = [layers[0]] + layers
        for layer in layers:
            h = layer(h)
        h = self.norm(h)
        if self.args.tiny_param:
            h = h * self.gain.mean()
        return self.output(h)

    def reset_parameters(self) -> None:
        """Deterministic init of every parameter (used after meta-device init)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if self.args.tiny_param:
            with torch.no_grad():
                self.gain.fill_(1.0)


def init_transformer(args: ModelArgs, seed: int = 0, device="cpu") -> Transformer:
    torch.manual_seed(seed)
    with torch.device(device):
        return Transformer(args)


def build_sharded_transformer(impl, args: ModelArgs, device: str, mesh, mp: bool, reshard: bool, meta: bool) -> Transformer:
    """A Transformer with every layer and the root sharded by `impl` (mp: bf16 params, fp32
    reduce), built on `device`, or on the meta device then materialized there (seed 1)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        model = Transformer(args)
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        impl.fully_shard(layer, **kw)
    impl.fully_shard(model, **kw)
    if meta:
        model.to_empty(device=device)
        torch.manual_seed(1)
        model.reset_parameters()
    return model


def make_batches(args: ModelArgs, n_batches: int, global_bsz: int, seed: int = 1234):
    """Deterministic (inputs, targets) token batches of shape (global_bsz, seq)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randint(0, args.vocab_size, (global_bsz, args.max_seq_len), generator=g)
        y = torch.randint(0, args.vocab_size, (global_bsz, args.max_seq_len), generator=g)
        out.append((x, y))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def copy_task(model, opt, args: ModelArgs, steps: int, gen: torch.Generator, device="cpu") -> list[float]:
    """``steps`` training steps of the copy task (predict the input token) on batches of 4
    random sequences from ``gen``; the losses."""
    losses = []
    for _ in range(steps):
        x = torch.randint(0, args.vocab_size, (4, args.max_seq_len), generator=gen).to(device)
        loss = lm_loss(model(x).float(), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class MLPStack(nn.Module):
    """A tiny MLP stack used by API / error tests."""

    def __init__(self, dim: int = 8, n: int = 3, bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=bias) for _ in range(n))
        self.out = nn.Linear(dim, 1, bias=bias)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


class ResidualMLP(nn.Module):
    """``x + fc2(relu(fc1(x)))``: the block of the small BlockStack models."""

    def __init__(self, dim: int = 6, hidden: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class TanhResidual(nn.Module):
    """``x + tanh(lin(x))``: a smooth block, for higher derivatives (test_higher_order,
    test_func_transforms)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class BlockStack(nn.Module):
    """``Linear(4, dim)``, then ``n`` blocks made by ``make_block()``, then ``Linear(dim, 1)``
    (parameter names ``inp.*``, ``blocks.<i>.*``, ``out.*``): the small models of the
    mixed-dtype tests."""

    def __init__(self, make_block, dim: int, n: int):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(make_block() for _ in range(n))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def shard_stack(impl, model, *, hsdp: bool = False, mp: bool = False, **kw):
    """``fully_shard`` on each of a BlockStack's blocks, then on the model, over every rank (1-D,
    or 2x2 HSDP); `mp`: bf16 parameters with fp32 reduction; `kw`: more fully_shard arguments."""
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")) if hsdp else init_device_mesh("cpu", (ws,))
    kw = dict(mesh=mesh, **kw)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    return model


def train_steps(model, steps: int = 3, accum: int = 1, batch: int = 6, dtype=torch.float32) -> list[float]:
    """AdamW steps (lr 1e-2) of a BlockStack-shaped model on this rank's own random inputs of 4
    features (generator seed 10 + rank), the loss the output's mean square; with `accum`
    micro-batches, gradient sync is off but on the last. Returns the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(steps):
        for micro in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)
            loss = model(torch.randn(batch, 4, generator=gen).to(dtype)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


# ---------------------------------------------------------------------------
# Sharding / training configurations shared by the test files
# ---------------------------------------------------------------------------
_BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# key -> (policy of the block units, policy of the root unit)
MP_POLICIES = {
    "bf16": (_BF16, _BF16),
    # The root casts its output (the logits) back to fp32.
    "bf16_out32": (_BF16, dict(_BF16, output_dtype=torch.float32)),
    # Different policies per unit: bf16 blocks cast their fp32 inputs to bf16 and
    # emit fp32; the root has no mixed precision.
    "bf16_blocks_out32": (dict(_BF16, output_dtype=torch.float32, cast_forward_inputs=True), None),
    # No input casting, bf16 gradient reduction (reduce_dtype=None).
    "bf16_nocast": (dict(param_dtype=torch.bfloat16, cast_forward_inputs=False),) * 2,
}


@dataclasses.dataclass
class Cfg:
    model: str = "even"  # "even" | "odd" (dim 0 not divisible by world size)
    mesh: str = "1d"  # "1d" | "hsdp" (2x2, world size 4) | "flat" | "hsdp_flat" (mesh_of)
    mp: str | None = None  # key of MP_POLICIES
    reshard: bool | int = True  # reshard_after_forward for every unit incl. root
    prefetch: bool = False  # explicit forward/backward prefetch
    accum: int = 1  # micro-batches per step, set_requires_gradient_sync(False) until the last
    reshard_after_backward: bool = True  # False: set_reshard_after_backward(False) for non-last micro-batches
    offload: bool = False  # CPUOffloadPolicy
    ac: bool = False  # activation checkpointing inside the blocks
    meta: bool = False  # meta-device init, to_empty + reset_parameters
    nested: bool = False  # block.feed_forward is its own unit inside the block unit
    frozen: bool = False  # frozen and trainable params in one unit
    tied: bool = False  # output.weight is tok_embeddings.weight
    twice: bool = False  # layers[0] is called twice per forward
    ignored: bool = False  # pos_embeddings.weight in ignored_params
    async_unshard: bool = False  # root.unshard(async_op=True) + handle.wait() before forward
    divide_factor: float | None = None  # set_gradient_divide_factor on every unit
    clip: float | None = None  # clip_grad_norm_ max_norm
    optim: str = "adamw"  # "adamw" | "sgd"
    steps: int = 3
    local_bsz: int = 2
    n_layers: int | None = None  # default: the base model's
    head_group: bool = False  # fully_shard([norm, output]): one unit of two modules (Accelerate's)
    dtype: torch.dtype | None = None  # the model converted to it before fully_shard (None: fp32)
    # shard_placement_fn: Shard(shard_dim) for every matrix whose size on that dim divides the
    # shard group (None: no shard_placement_fn, every parameter on dim 0).
    shard_dim: int | None = None

    @property
    def model_args(self):
        base = ODD if self.model == "odd" else EVEN
        return dataclasses.replace(
            base,
            n_layers=self.n_layers or base.n_layers,
            weight_tying=self.tied,
            checkpoint_activations=self.ac,
            repeat_first_layer=self.twice,
        )


def make_mesh(cfg: Cfg):
    return mesh_of(cfg.mesh)


def mesh_of(kind: str):
    """"1d": every rank in one shard group; "hsdp": 2 replicas x 2 shards (world size 4).
    "flat" and "hsdp_flat" (world size 4): the same two, with the shard dim a flattened one, as
    Accelerate's ParallelismConfig and torchtitan build it for context parallelism: a root mesh
    (dp_replicate, dp_shard, cp), dims ("dp_shard", "cp") flattened to "dp_shard_cp", and FSDP on
    that dim ("flat": dp_shard 2 x cp 2) or on ("dp_replicate", "dp_shard_cp") ("hsdp_flat":
    dp_replicate 2, dp_shard 1 x cp 2)."""
    ws = dist.get_world_size()
    if kind == "hsdp":
        assert ws == 4
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if kind in ("flat", "hsdp_flat"):
        assert ws == 4
        shape = (1, 2, 2) if kind == "flat" else (2, 1, 2)
        root = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        flat = root["dp_shard", "cp"]._flatten("dp_shard_cp")
        return flat if kind == "flat" else root["dp_replicate", "dp_shard_cp"]
    return init_device_mesh("cpu", (ws,))


def freeze_some(model: Transformer) -> None:
    # Frozen and trainable parameters in the same units (block 0 and root).
    model.layers[0].attention.wq.weight.requires_grad_(False)
    model.layers[0].ffn_norm.weight.requires_grad_(False)
    model.pos_embeddings.weight.requires_grad_(False)


def build_fsdp(impl, cfg: Cfg, mesh, seed: int = 0) -> Transformer:
    args = cfg.model_args
    torch.manual_seed(seed)
    with torch.device("meta" if cfg.meta else "cpu"):
        model = Transformer(args)
    if cfg.frozen:
        freeze_some(model)
    if cfg.dtype is not None:
        model.to(cfg.dtype)
    kw = dict(mesh=mesh, reshard_after_forward=cfg.reshard)
    root_kw = dict(kw)
    if cfg.mp is not None:
        block_mp, root_mp = MP_POLICIES[cfg.mp]
        kw["mp_policy"] = impl.MixedPrecisionPolicy(**block_mp)
        if root_mp is not None:
            root_kw["mp_policy"] = impl.MixedPrecisionPolicy(**root_mp)
    if cfg.offload:
        kw["offload_policy"] = root_kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    if cfg.shard_dim is not None:
        kw["shard_placement_fn"] = root_kw["shard_placement_fn"] = shard_on(cfg.shard_dim, mesh.size(mesh.ndim - 1))
    for layer in model.layers:
        if cfg.nested:
            impl.fully_shard(layer.feed_forward, **kw)
        impl.fully_shard(layer, **kw)
    if cfg.head_group:
        impl.fully_shard([model.norm, model.output], **kw)
    if cfg.ignored:
        root_kw["ignored_params"] = {model.pos_embeddings.weight}
    out = impl.fully_shard(model, **root_kw)
    assert out is model, f"{impl.name}: fully_shard must return the module itself"
    if cfg.meta:
        model.to_empty(device="cpu")
        torch.manual_seed(seed + 1)
        model.reset_parameters()
    if cfg.prefetch:
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    if cfg.divide_factor is not None:
        for m in model.modules():
            if isinstance(m, impl.FSDPModule):
                m.set_gradient_divide_factor(cfg.divide_factor)
                # torch FSDP2 would use ReduceOp.PREMUL_SUM, which gloo lacks;
                # sum-only reductions (then a division) are what a gloo user sets.
                m.set_force_sum_reduction_for_comms(True)
    return model


def shard_on(dim: int, shard_size: int):
    """A shard_placement_fn: ``Shard(dim)`` for a parameter of 2 or more dims whose size on
    `dim` divides `shard_size` (torch FSDP2 shards a dim other than 0 evenly only), else None
    (dim 0)."""

    def fn(p):
        return Shard(dim) if p.dim() >= 2 and p.shape[dim] % shard_size == 0 else None

    return fn


def make_optim(cfg: Cfg, params):
    params = [p for p in params if p.requires_grad]
    if cfg.optim == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _data(cfg: Cfg, n_data_ranks: int):
    return make_batches(cfg.model_args, cfg.steps * cfg.accum, cfg.local_bsz * n_data_ranks, seed=1234)


def train_fsdp(impl, model, cfg: Cfg, opt=None, start: int = 0, stop: int | None = None) -> dict:
    """Train ``model`` (sharded by ``impl``) on this rank's slice of the global batches.

    Runs steps ``start .. stop-1`` of the deterministic data stream (for resume
    tests); returns losses, clip norms, the first step's gradients, the final
    parameters and the optimizer.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    batches = _data(cfg, ws)
    opt = opt if opt is not None else make_optim(cfg, model.parameters())
    lo, hi = rank * cfg.local_bsz, (rank + 1) * cfg.local_bsz
    losses, norms, grads0 = [], [], None
    for step in range(start, cfg.steps if stop is None else stop):
        if cfg.async_unshard:
            handle = model.unshard(async_op=True)
            assert handle is not None and callable(getattr(handle, "wait", None)), (
                f"{impl.name}: unshard(async_op=True) must return a handle with .wait(), got {handle!r}"
            )
            handle.wait()
            w = model.tok_embeddings.weight
            assert not isinstance(w, DTensor) and tuple(w.shape) == (cfg.model_args.vocab_size, cfg.model_args.dim), (
                f"{impl.name}: after unshard().wait() the root's parameters must be unsharded, "
                f"got {type(w).__name__} of shape {tuple(w.shape)}"
            )
            # Not waited on explicitly: the block's pre-forward must wait for it.
            model.layers[0].unshard(async_op=True)
        for micro in range(cfg.accum):
            last = micro == cfg.accum - 1
            if cfg.accum > 1:
                model.set_requires_gradient_sync(last)
                if not cfg.reshard_after_backward:
                    model.set_reshard_after_backward(last)
            x, y = batches[step * cfg.accum + micro]
            loss = lm_loss(model(x[lo:hi]), y[lo:hi])
            loss.backward()
            losses.append(loss.detach().float().item())
        if step == start:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters()}
        if cfg.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg.clip)
            norms.append(full(norm).item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, norms=norms, grads0=grads0, params=full_params(model), opt=opt)


def train_reference(model, cfg: Cfg, n_data_ranks: int) -> dict:
    """Unsharded training on the global batch; per-rank losses from the same logits."""
    batches = _data(cfg, n_data_ranks)
    opt = make_optim(cfg, model.parameters())
    rank = dist.get_rank()
    lo, hi = rank * cfg.local_bsz, (rank + 1) * cfg.local_bsz
    losses, norms, grads0 = [], [], None
    for step in range(cfg.steps):
        for micro in range(cfg.accum):
            x, y = batches[step * cfg.accum + micro]
            logits = model(x)
            loss = lm_loss(logits, y)  # mean over the global batch == mean of rank means
            loss.backward()
            losses.append(lm_loss(logits[lo:hi], y[lo:hi]).detach().item())
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters()}
        if cfg.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg.clip).item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, norms=norms, grads0=grads0, params=full_params(model))
