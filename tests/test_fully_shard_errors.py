"""Invalid uses of fully_shard must raise the same exception on every rank, and never hang.

Expected messages (the tests match the argument name; the rest is the suggested wording).
ValueError = bad value, TypeError = wrong type, NotImplementedError = valid but unsupported.

  conflicting re-application     ValueError   "fully_shard: argument 'reshard_after_forward' is False, but module
                                              'layers.0' is already sharded with reshard_after_forward=True"
                                 ValueError   "fully_shard: argument 'mp_policy' is MixedPrecisionPolicy(...), but
                                              module ... is already sharded with mp_policy=MixedPrecisionPolicy(...)"
  parameters on cpu and meta     ValueError   "fully_shard: argument 'module' has parameters on mixed devices
                                              (cpu: 'layers.0.weight', ...; meta: 'layers.1.weight', ...)"
  3-D mesh                       ValueError   "fully_shard: argument 'mesh' must be a 1-D (FSDP) or 2-D (HSDP)
                                              DeviceMesh, got a 3-D mesh"
  mesh of the wrong type         TypeError    "fully_shard: argument 'mesh' must be a DeviceMesh, got str"
  non-floating param_dtype       ValueError   "fully_shard: argument 'mp_policy.param_dtype' is torch.int32,
                                              expected a floating dtype"
  non-floating reduce_dtype      ValueError   "fully_shard: argument 'mp_policy.reduce_dtype' is torch.int64,
                                              expected a floating dtype"
  mp_policy of the wrong type    TypeError    "fully_shard: argument 'mp_policy' must be a MixedPrecisionPolicy, got str"
  param shapes differ by rank    ValueError   (at the first forward, every rank; no collective in fully_shard)
                                              "fsdp_native: the fully_shard structure differs across ranks ...:
                                              unit 0 '<root>': parameter 'layers.0.weight' has shape (8, 8) on
                                              ranks [0] but (9, 8) on ranks [1]; ..."  (tests/test_agreement.py)
  offload_policy of wrong type   TypeError    "fully_shard: argument 'offload_policy' must be an OffloadPolicy
                                              (OffloadPolicy() or CPUOffloadPolicy()) or None, got str"
  unknown OffloadPolicy subclass NotImplementedError "fully_shard: argument 'offload_policy' of type
                                              MyOffloadPolicy is not supported; use OffloadPolicy() or
                                              CPUOffloadPolicy()"
  reshard_after_forward=3, ws 2  ValueError   "fully_shard: argument 'reshard_after_forward' is 3, expected a bool
                                              or a divisor of the shard group size 2"
  reshard_after_forward="yes"    TypeError    "fully_shard: argument 'reshard_after_forward' must be a bool or an
                                              int, got str"
  scalar (0-dim) parameter       ValueError   "fully_shard: argument 'module' has a scalar (0-dim) parameter
                                              'scale'; FSDP shards dim 0, make it a 1-D tensor of size 1"
  container without forward      ValueError   "fully_shard: argument 'module' is a ModuleList, a container
                                              without forward; shard its children instead"
  module of the wrong type       TypeError    (exact messages in case() below, as for the next two)
  shard_placement_fn=Shard(0)    TypeError    (torch: "'Shard' object is not callable")
  ignored_params of names, or    TypeError    (torch: names ignore nothing, without a word)
  of one parameter
  forward with meta parameters   RuntimeError (at forward, every rank) "... 'layers.0.weight' ... still on the
                                              meta device; call module.to_empty(...) and initialise them ..."
  shard_placement_fn: Shard(2)   ValueError   (exact messages in case() below; torch raises AssertionError)
  of a matrix, Replicate(),      ValueError
  Shard(1) of a dim of 9 ranks   NotImplementedError (as torch: a dim other than 0 is sharded evenly only)
  copy.deepcopy of a sharded     AssertionError (as torch; what swa_utils.AveragedModel, an EMA copy, does)
  module                                      "fsdp_native: FSDP modules do not support deepcopy; use the state dict"
  p.grad_dtype = torch.float32   NotImplementedError on torch 2.15, whose FSDP2 keeps fp32 gradients for such
  on a bf16 parameter                         a parameter (exact message in case() below); before 2.15 FSDP2
                                              drops the override, and so does fsdp_native

After each case every rank runs a collective that checks the process group is
still usable and in step (a rank that hung or issued an extra collective fails it).
"""
from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_utils import load_impl, raises_exactly, run_distributed, run_grid
from fsdp_native import _compat
from models import MLPStack


def _mesh1d():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _check_group_in_step():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    ws = dist.get_world_size()
    assert t.item() == ws * (ws + 1) / 2, f"process group out of step after the error: {t.item()}"


def _expect(exc_type, pattern, fn, *also_in_message):
    with pytest.raises(exc_type, match=pattern) as info:
        fn()
    msg = str(info.value)
    for s in also_in_message:
        assert s in msg, f"{exc_type.__name__} message should mention {s!r}: {msg!r}"
    return info.value


class _ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) * self.scale


class _SparseEmbedding(nn.Module):
    def __init__(self, bag: bool):
        super().__init__()
        self.bag = bag
        self.emb = nn.EmbeddingBag(20, 8, sparse=True) if bag else nn.Embedding(20, 8, sparse=True)
        self.out = nn.Linear(8, 1)

    def forward(self, idx):
        return self.out(self.emb(idx) if self.bag else self.emb(idx).mean(1))


def case(name):
    impl = load_impl()
    fs = impl.fully_shard
    mesh = _mesh1d()
    rank = dist.get_rank()

    if name == "conflicting_reshard_after_forward":
        m = MLPStack()
        fs(m.layers[0], mesh=mesh, reshard_after_forward=True)
        _expect(ValueError, r"reshard_after_forward",
                lambda: fs(m.layers[0], mesh=mesh, reshard_after_forward=False))
    elif name == "conflicting_mp_policy":
        m = MLPStack()
        fs(m.layers[0], mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        _expect(ValueError, r"mp_policy",
                lambda: fs(m.layers[0], mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.float16)))
    elif name == "mixed_devices":
        m = MLPStack()
        m.layers[1].to("meta")
        _expect(ValueError, r"'module'.*mixed devices|mixed devices.*'module'", lambda: fs(m, mesh=mesh),
                "cpu", "meta")
    elif name == "mesh_3d":
        mesh3 = init_device_mesh("cpu", (1, 1, dist.get_world_size()))
        _expect(ValueError, r"mesh", lambda: fs(MLPStack(), mesh=mesh3), "3")
    elif name == "mesh_wrong_type":
        _expect(TypeError, r"mesh", lambda: fs(MLPStack(), mesh="cpu"))
    elif name == "param_dtype_int32":
        _expect(ValueError, r"param_dtype",
                lambda: fs(MLPStack(), mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.int32)),
                "int32")
    elif name == "reduce_dtype_int64":
        _expect(ValueError, r"reduce_dtype",
                lambda: fs(MLPStack(), mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(reduce_dtype=torch.int64)),
                "int64")
    elif name == "mp_policy_wrong_type":
        _expect(TypeError, r"mp_policy", lambda: fs(MLPStack(), mesh=mesh, mp_policy="bf16"))
    elif name == "rank_dependent_out_features":
        m = MLPStack()
        m.layers[0] = nn.Linear(8, 8 + rank)  # dim 0 of weight and bias differs across ranks
        fs(m, mesh=mesh)  # no collective in fully_shard: the structure is checked at the first forward
        _expect(ValueError, r"shape", lambda: m(torch.randn(2, 8)), "layers.0.")
    elif name == "rank_dependent_in_features":
        m = MLPStack()
        m.layers[1] = nn.Linear(8 + rank, 8)  # only dim 1 of the weight differs
        fs(m.layers[2], mesh=mesh)  # a valid unit first
        fs(m.layers[1], mesh=mesh)
        fs(m, mesh=mesh)
        _expect(ValueError, r"shape", lambda: m(torch.randn(2, 8)), "weight")
    elif name == "offload_policy_wrong_type":
        _expect(TypeError, r"offload_policy", lambda: fs(MLPStack(), mesh=mesh, offload_policy="cpu"), "or None, got str")
    elif name == "offload_policy_unsupported":

        class MyOffloadPolicy(impl.OffloadPolicy):
            pass

        _expect(NotImplementedError, r"offload_policy",
                lambda: fs(MLPStack(), mesh=mesh, offload_policy=MyOffloadPolicy()), "MyOffloadPolicy")
    elif name == "reshard_after_forward_bad_int":
        _expect(ValueError, r"reshard_after_forward", lambda: fs(MLPStack(), mesh=mesh, reshard_after_forward=3), "3")
    elif name == "reshard_after_forward_wrong_type":
        _expect(TypeError, r"reshard_after_forward",
                lambda: fs(MLPStack(), mesh=mesh, reshard_after_forward="yes"))
    elif name == "scalar_param":
        _expect(ValueError, r"scalar", lambda: fs(_ScalarParam(), mesh=mesh), "scale")
    elif name == "container_without_forward":
        _expect(ValueError, r"ModuleList", lambda: fs(nn.ModuleList([nn.Linear(4, 4)]), mesh=mesh))
    elif name == "module_wrong_type":
        raises_exactly(
            TypeError, "fully_shard: argument 'module' must be an nn.Module or a list of them, got int", lambda: fs(3, mesh=mesh)
        )
    elif name == "shard_placement_fn_not_callable":
        m = MLPStack()
        raises_exactly(
            TypeError,
            "fully_shard: argument 'shard_placement_fn' must be a function of a parameter returning None or a Shard "
            "placement, or None, got Shard",
            lambda: fs(m, mesh=mesh, shard_placement_fn=Shard(0)),
        )
        assert not any(isinstance(p, DTensor) for p in m.parameters()), "a refused fully_shard must leave the module as it was"
    elif name == "ignored_params_wrong_type":
        m = MLPStack()
        raises_exactly(
            TypeError,
            "fully_shard: argument 'ignored_params' holds 'layers.0.weight' (str), expected the parameters themselves "
            "(module.weight, not its name)",
            lambda: fs(m, mesh=mesh, ignored_params={"layers.0.weight"}),
        )
        raises_exactly(
            TypeError,
            "fully_shard: argument 'ignored_params' must be a set of parameters or None, got Parameter",
            lambda: fs(m, mesh=mesh, ignored_params=m.layers[0].weight),
        )
        assert not any(isinstance(p, DTensor) for p in m.parameters()), "a refused fully_shard must leave the module as it was"
        fs(m, mesh=mesh, ignored_params=(p for p in [m.layers[0].weight]))  # any iterable of parameters, as a set
        assert not isinstance(m.layers[0].weight, DTensor) and isinstance(m.layers[1].weight, DTensor)
    elif name == "shard_placement_bad_dim":
        raises_exactly(
            ValueError,
            "fully_shard: argument 'shard_placement_fn' returned Shard(2) for parameter 'layers.0.weight' of shape "
            "(8, 8), expected a dim in [-2, 1]",
            lambda: fs(MLPStack(), mesh=mesh, shard_placement_fn=lambda p: Shard(2)),
        )
    elif name == "shard_placement_not_shard":
        raises_exactly(
            ValueError,
            "fully_shard: argument 'shard_placement_fn' returned Replicate() for parameter 'layers.0.bias', expected "
            "None or a Shard placement",
            lambda: fs(MLPStack(), mesh=mesh, shard_placement_fn=lambda p: Replicate() if p.dim() == 1 else None),
        )
    elif name == "shard_placement_uneven_dim":
        m = MLPStack()
        m.layers[1] = nn.Linear(9, 8)
        raises_exactly(
            NotImplementedError,
            "fully_shard: argument 'shard_placement_fn' returned Shard(-1) for parameter 'layers.1.weight' of shape "
            "(8, 9), whose size 9 on dim 1 does not divide evenly over the 2 shard ranks; like torch FSDP2, "
            "fsdp_native shards a dim other than 0 evenly only",
            lambda: fs(m, mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.dim() == 2 else None),
        )
        assert not any(isinstance(p, DTensor) for p in m.parameters()), "a refused fully_shard must leave the module as it was"
    elif name == "forward_with_meta_params":
        with torch.device("meta"):
            m = MLPStack()
        for layer in m.layers:
            fs(layer, mesh=mesh)
        fs(m, mesh=mesh)
        # never materialised: forward must raise on every rank instead of all-gathering
        _expect(RuntimeError, r"meta", lambda: m(torch.randn(2, 8)))
    elif name == "deepcopy":
        m = MLPStack()
        fs(m.layers[0], mesh=mesh)
        fs(m, mesh=mesh)
        for what in (m, m.layers[0]):
            _expect(AssertionError, r"deepcopy", lambda: copy.deepcopy(what), "state dict")
        e = _expect(AssertionError, r"deepcopy",
                    lambda: torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)))
        if impl.name == "fsdp_native":
            assert str(e) == "fsdp_native: FSDP modules do not support deepcopy; use the state dict", str(e)
    elif name == "grad_dtype_override":
        m = MLPStack().bfloat16()
        m.layers[0].weight.grad_dtype = torch.float32
        if _compat.GRAD_IN_REDUCE_DTYPE and impl.name == "fsdp_native":
            raises_exactly(
                NotImplementedError,
                "fully_shard: parameter 'layers.0.weight' has grad_dtype torch.float32 and dtype torch.bfloat16; "
                "fsdp_native keeps each sharded gradient in its parameter's dtype (torch 2.15's FSDP2 keeps the "
                "grad_dtype): set p.grad_dtype = p.dtype, and MixedPrecisionPolicy(reduce_dtype=...) for the dtype of "
                "the reduction",
                lambda: fs(m, mesh=mesh),
            )
            assert not any(isinstance(p, DTensor) for p in m.parameters()), "a refused fully_shard must leave the module as it was"
        elif not _compat.GRAD_IN_REDUCE_DTYPE:  # before 2.15 FSDP2 drops the override: gradients in the param dtype
            fs(m, mesh=mesh)
            m(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
            assert m.layers[0].weight.grad.dtype == torch.bfloat16, m.layers[0].weight.grad.dtype
    elif name == "sparse_gradient":
        # nn.Embedding(sparse=True): torch FSDP2 fails in its copy-in ("Could not run
        # 'fsdp::chunk_cat' with arguments from the 'SparseCPU' backend").
        for bag in (False, True):
            m = _SparseEmbedding(bag)
            fs(m.emb, mesh=mesh)
            fs(m, mesh=mesh)
            idx = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(rank))
            step = lambda: m(idx).sum().backward()  # noqa: E731
            if impl.name == "fsdp_native":
                raises_exactly(
                    ValueError,
                    f"fully_shard: parameter 'weight' of FSDP{'EmbeddingBag' if bag else 'Embedding'} in unit 'emb' got "
                    "a gradient of layout torch.sparse_coo, expected torch.strided: gradients are reduce-scattered "
                    "dense. Build the module with sparse=False (nn.Embedding, nn.EmbeddingBag).",
                    step,
                )
            else:
                _expect(NotImplementedError, "SparseCPU", step)
            m.reset_iter_state()
    else:
        raise AssertionError(f"unknown case {name}")
    _check_group_in_step()


CASES = [
    "conflicting_reshard_after_forward",
    "conflicting_mp_policy",
    "mixed_devices",
    "mesh_3d",
    "mesh_wrong_type",
    "param_dtype_int32",
    "reduce_dtype_int64",
    "mp_policy_wrong_type",
    "rank_dependent_out_features",
    "rank_dependent_in_features",
    "offload_policy_wrong_type",
    "offload_policy_unsupported",
    "reshard_after_forward_bad_int",
    "reshard_after_forward_wrong_type",
    "scalar_param",
    "container_without_forward",
    "module_wrong_type",
    "shard_placement_fn_not_callable",
    "ignored_params_wrong_type",
    "forward_with_meta_params",
    "shard_placement_bad_dim",
    "shard_placement_not_shard",
    "shard_placement_uneven_dim",
    "deepcopy",
    "grad_dtype_override",
    "sparse_gradient",
]


def _errors_grid():
    run_grid([dict(name=n) for n in CASES], case, name="errors")


def test_invalid_arguments_raise_on_every_rank():
    run_distributed(_errors_grid, 2, timeout=180)


# ---------------------------------------------------------------------------
# The harness itself: failures, collective timeouts and hangs are reported,
# never stall the suite.
# ---------------------------------------------------------------------------
def _selfcheck_body(kind):
    rank = dist.get_rank()
    if kind == "assert_on_rank_1" and rank == 1:
        raise AssertionError("deliberate failure on rank 1")
    if kind == "collective_peer_never_joins" and rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: gloo times out
    if kind == "healthy_after_failures":
        _check_group_in_step()  # the group was re-created after the failures
    if kind == "hang" and rank == 1:
        time.sleep(3600)


def _selfcheck_grid():
    kinds = ["assert_on_rank_1", "collective_peer_never_joins", "healthy_after_failures", "hang"]
    run_grid([dict(kind=k) for k in kinds], _selfcheck_body, name="selfcheck")


def test_harness_reports_failures_collective_timeouts_and_hangs():
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_selfcheck_grid, 2, timeout=25, pg_timeout=2)
    assert time.monotonic() - t0 < 60, "the harness did not enforce its timeout"
    msg = str(info.value)
    assert "[selfcheck: kind='assert_on_rank_1'] ranks [1]: AssertionError: deliberate failure on rank 1" in msg, msg
    assert "[selfcheck: kind='collective_peer_never_joins'] ranks [0]" in msg, msg
    assert "kind='healthy_after_failures'] ranks" not in msg, msg
    assert "TIMEOUT" in msg and "rank 1: [selfcheck: kind='hang']" in msg, msg
    assert "stack dump rank 1" in msg and "_selfcheck_body" in msg, msg
    assert "Traceback" in msg and "deliberate failure on rank 1" in msg
