"""torch 2.15's mixed-precision changes, on every supported torch.

* ``MixedPrecisionPolicy(param_dtype_override_fn=...)``: some parameters of a bf16 unit keep
  their fp32 dtype for compute (e.g. the ``A_log`` / ``dt_bias`` of linear-attention mixers).
  fsdp_native gathers them in the unit's one all-gather (bytes, one casting copy-in per run
  of one dtype). Reference on any torch: torch FSDP2 with those parameters in units of their
  own (``param_dtype=None``), which computes the same numbers; where the installed torch has
  the field (2.15), also torch FSDP2 with the same override in one unit. Bit for bit, also
  with gradient accumulation and on HSDP 2x2.
* ``reduce_dtype=None`` means what it means in the installed torch: the gradients of fp32
  parameters computed in bf16 are reduced in bf16 before 2.15 and in fp32 from 2.15
  (``fsdp_native._compat.REDUCE_IN_ORIG_DTYPE``). Bit for bit against torch FSDP2; the two
  reductions give different numbers, so a wrong choice fails.
* The dtype autograd hands the unsharded gradients over in (torch 2.15's ``grad_dtype`` on the
  unsharded parameters, ``fsdp_native._compat.GRAD_IN_REDUCE_DTYPE``): a Linear applied twice
  and a GRU (its recurrent weight is used at every step), with a bf16 policy and fp32
  reduction, and with fp32 compute and bf16 reduction (there torch 2.15 casts each
  contribution to bf16 before summing), with and without gradient accumulation, bit for bit
  torch FSDP2's. From 2.15 the
  first micro-batch without sync sums such contributions in fp32 and every other backward in
  bf16; before 2.15 all in bf16; an unsharded bf16 model with ``grad_dtype`` fp32 sums them in
  fp32 always, so neither a fixed ``grad_dtype`` nor none matches torch 2.15.
* Bad overrides raise at ``fully_shard`` naming the parameter.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import assert_close, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, train_steps

EXACT = dict(rtol=0, atol=0)


def _torch_has_override() -> bool:
    import torch.distributed.fsdp as tf

    return "param_dtype_override_fn" in {f.name for f in dataclasses.fields(tf.MixedPrecisionPolicy)}


class Gate(nn.Module):
    """fp32-only parameters (marked ``_keep_fp32``), used in fp32 whatever the input dtype."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.mix = nn.Parameter(0.1 * torch.randn(dim, 3))
        for p in (self.scale, self.mix):
            p._keep_fp32 = True

    def forward(self, x):
        h = x.float()
        return (h * self.scale.float() + (h @ self.mix.float()).sum(-1, keepdim=True)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.gate = Gate(2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.gate(self.up(x))))


class Model(BlockStack):
    def __init__(self, dim: int = 6, n: int = 2):
        super().__init__(lambda: Block(dim), dim, n)


def _keep_fp32(p: nn.Parameter):
    return torch.float32 if getattr(p, "_keep_fp32", False) else None


def _train(impl, mesh, variant: str, accum: int, reduce_dtype, steps: int = 3, policy_cls=None) -> dict:
    """variant: 'override' (one unit per block, the override keeps the Gate's parameters in
    fp32), 'split' (the Gate in a unit of its own with param_dtype=None), 'plain' (bf16
    everywhere)."""
    torch.manual_seed(0)
    model = Model()
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    kw = dict(mesh=mesh)
    policy_cls = policy_cls or impl.MixedPrecisionPolicy
    for b in model.blocks:
        if variant == "override":
            impl.fully_shard(b, mp_policy=policy_cls(**bf16, param_dtype_override_fn=_keep_fp32), **kw)
        else:
            if variant == "split":
                impl.fully_shard(b.gate, mp_policy=impl.MixedPrecisionPolicy(reduce_dtype=reduce_dtype), **kw)
            impl.fully_shard(b, mp_policy=impl.MixedPrecisionPolicy(**bf16), **kw)
    # The root has no fp32-kept parameters: its reduce dtype is set, except in 'plain'.
    root_reduce = reduce_dtype if variant == "plain" else torch.float32
    impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=root_reduce), **kw)
    losses = train_steps(model, steps, accum, batch=5)
    return dict(losses=losses, params=full_params(model))


def _same(tag: str, got: dict, ref: dict) -> None:
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    assert got["params"].keys() == ref["params"].keys()
    for n, v in ref["params"].items():
        assert got["params"][n].dtype == v.dtype, (n, got["params"][n].dtype, v.dtype)
        assert_close(f"{tag} param {n!r}", got["params"][n], v, EXACT)


def _mesh(kind: str):
    ws = dist.get_world_size()
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (ws,))


def _check_override(accum: int, mesh_kind: str = "1d") -> None:
    impl, torch_impl = load_impl(), ref_impl()
    mesh = _mesh(mesh_kind)
    got = _train(impl, mesh, "override", accum, None)
    # torch's gradients of the Gate are fp32 and every other one is reduced in fp32 with it
    ref = _train(torch_impl, mesh, "split", accum, torch.float32)
    _same(f"[{impl.name} override vs torch split units, accum={accum}, {mesh_kind}]", got, ref)
    if _torch_has_override():
        ref = _train(torch_impl, mesh, "override", accum, None)
        _same(f"[{impl.name} override vs torch override, accum={accum}, {mesh_kind}]", got, ref)
        # torch 2.15's own policy object, handed to fsdp_native as it is
        theirs = _train(impl, mesh, "override", accum, None, policy_cls=torch_impl.MixedPrecisionPolicy)
        _same(f"[{impl.name} with torch's policy object, accum={accum}, {mesh_kind}]", theirs, ref)


def _unsharded_dtypes() -> None:
    """The override decides each unsharded parameter's dtype in the forward."""
    impl = load_impl()
    torch.manual_seed(0)
    model = Model(n=1)
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=_keep_fp32)
    impl.fully_shard(model.blocks[0], mp_policy=mp, mesh=_mesh("1d"))
    impl.fully_shard(model, mesh=_mesh("1d"), mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}

    def hook(mod, args):
        for n, p in mod.named_parameters(recurse=False):
            seen[f"{type(mod).__name__}.{n}"] = p.dtype

    for m in model.blocks[0].modules():
        m.register_forward_pre_hook(hook)
    model(torch.randn(2, 4))
    assert seen == {
        "Linear.weight": torch.bfloat16,
        "Linear.bias": torch.bfloat16,
        "Gate.scale": torch.float32,
        "Gate.mix": torch.float32,
    }, seen


def _grid_ws2():
    run_grid([dict(accum=1), dict(accum=2)], _check_override, name="override")
    _unsharded_dtypes()


def test_param_dtype_override_ws2():
    run_distributed(_grid_ws2, 2)


def _grid_hsdp():
    run_grid([dict(accum=2, mesh_kind="hsdp")], _check_override, name="override-hsdp")


def test_param_dtype_override_hsdp():
    run_distributed(_grid_hsdp, 4)


def _check_reduce_none(accum: int) -> None:
    """reduce_dtype=None: the installed torch's rule, bit for bit."""
    impl, torch_impl = load_impl(), ref_impl()
    mesh = _mesh("1d")
    got = _train(impl, mesh, "plain", accum, None)
    ref = _train(torch_impl, mesh, "plain", accum, None)
    _same(f"[{impl.name} vs torch {torch.__version__}, reduce_dtype=None, accum={accum}]", got, ref)
    # ... and the two rules give different numbers here, so the test tells them apart
    other = _train(torch_impl, mesh, "plain", accum, torch.bfloat16 if _reduces_in_orig() else torch.float32)
    assert got["params"]["inp.weight"].ne(other["params"]["inp.weight"]).any(), "both reduce dtypes gave the same numbers"


def _reduces_in_orig() -> bool:
    from fsdp_native import _compat

    return _compat.REDUCE_IN_ORIG_DTYPE


def _grid_reduce_none():
    run_grid([dict(accum=1), dict(accum=2)], _check_reduce_none, name="reduce-none")


def test_reduce_dtype_none_follows_installed_torch():
    run_distributed(_grid_reduce_none, 2)


def test_reduce_rule_matches_torch_version():
    from fsdp_native import _compat

    assert _compat.REDUCE_IN_ORIG_DTYPE == (_compat.TORCH_VERSION >= (2, 15))


def _bad_overrides() -> None:
    from fsdp_native import MixedPrecisionPolicy, fully_shard

    mesh = _mesh("1d")
    cases = [
        (
            lambda p: "float32",
            ValueError,
            "fully_shard: argument 'mp_policy.param_dtype_override_fn' returned a str for parameter 'up.weight', "
            "expected a torch.dtype or None",
        ),
        (
            lambda p: torch.float16,
            ValueError,
            "fully_shard: argument 'mp_policy.param_dtype_override_fn' returned torch.float16 for parameter "
            "'up.weight' of dtype torch.float32, expected None, param_dtype (torch.bfloat16) or the parameter's own dtype",
        ),
    ]
    for fn, exc, msg in cases:
        block = Block(4)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=fn)
        raises_exactly(exc, msg, lambda: fully_shard(block, mesh=mesh, mp_policy=mp))
        assert not hasattr(block, "_fsdp_native_unit")


def test_bad_override_raises():
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's own error messages")
    run_distributed(_bad_overrides, 1)


def test_override_kept_and_must_be_callable():
    from fsdp_native._api import normalize_mp_policy

    @dataclasses.dataclass(frozen=True)
    class Newer:  # torch 2.15's fields, whatever torch is installed
        param_dtype: torch.dtype | None = torch.bfloat16
        reduce_dtype: torch.dtype | None = None
        output_dtype: torch.dtype | None = None
        cast_forward_inputs: bool = True
        param_dtype_override_fn: object = None

    assert normalize_mp_policy(Newer()).param_dtype == torch.bfloat16
    assert normalize_mp_policy(Newer()).param_dtype_override_fn is None
    fn = _keep_fp32  # kept, not dropped (which would cast every parameter to param_dtype)
    assert normalize_mp_policy(Newer(param_dtype_override_fn=fn)).param_dtype_override_fn is fn
    raises_exactly(
        TypeError,
        "fully_shard: argument 'mp_policy.param_dtype_override_fn' is a dtype, expected a callable taking a parameter, or None",
        lambda: normalize_mp_policy(Newer(param_dtype_override_fn=torch.float32)),
    )


def _keep_nothing(p: nn.Parameter):
    return None


def _override_differs_across_ranks() -> None:
    """The structure check (first forward) compares the dtypes the override chose, not the
    function: a rank whose override keeps nothing in fp32 makes every rank raise."""
    from fsdp_native import MixedPrecisionPolicy, fully_shard

    fn = _keep_fp32 if dist.get_rank() == 0 else _keep_nothing
    torch.manual_seed(0)
    model = Model(n=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=fn)
    fully_shard(model.blocks[0], mp_policy=mp, mesh=_mesh("1d"))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), mesh=_mesh("1d"))
    with pytest.raises(ValueError) as info:
        model(torch.randn(2, 4))
    msg = str(info.value)
    policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)"
    assert (
        f"'blocks.0': mp_policy is {policy} with param_dtype_override_fn giving ['float32', 'float32', 'bfloat16', "
        f"'bfloat16', 'bfloat16', 'bfloat16'] on ranks [0] but {policy} with param_dtype_override_fn giving "
        "['bfloat16', 'bfloat16', 'bfloat16', 'bfloat16', 'bfloat16', 'bfloat16'] on ranks [1]"
    ) in msg, msg


def test_override_mismatch_across_ranks_raises():
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's structure check")
    run_distributed(_override_differs_across_ranks, 2)


class Reused(nn.Module):
    """A Linear applied twice and a GRU over 3 steps: parameters with several gradient
    contributions per backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gru = nn.GRU(6, 6, batch_first=True)

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(x)))
        return self.gru(h.unsqueeze(1) * torch.arange(1, 4, dtype=h.dtype).view(1, 3, 1))[0][:, -1]


_REUSED_POLICIES = {
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "reduce_bf16": dict(reduce_dtype=torch.bfloat16),  # fp32 compute: grad_dtype bf16, narrower
}


def _train_reused(impl, accum: int, policy: str) -> dict:
    torch.manual_seed(0)
    model = BlockStack(Reused, dim=6, n=2)
    mp = impl.MixedPrecisionPolicy(**_REUSED_POLICIES[policy])
    for b in model.blocks:
        impl.fully_shard(b, mp_policy=mp)
    impl.fully_shard(model, mp_policy=mp)
    return dict(losses=train_steps(model, accum=accum), params=full_params(model))


def _check_reused(accum: int, policy: str) -> None:
    what = f"[reused parameters, accum {accum}, {policy}]"
    _same(what, _train_reused(load_impl(), accum, policy), _train_reused(ref_impl(), accum, policy))


def _grid_reused():
    run_grid([dict(accum=a, policy=p) for p in _REUSED_POLICIES for a in (1, 3)], _check_reused)


def test_reused_parameters_gradient_dtype_matches_torch():
    run_distributed(_grid_reused, 2)
