"""torch's optimizers choose their foreach (multi-tensor) path by the exact parameter type;
fsdp_native's ShardedDTensor parameters must get the same choice as torch FSDP2's DTensors,
or on CUDA AdamW falls back to its per-parameter loop (slower, and rounding differently)."""
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._foreach_utils import _has_foreach_support

import fsdp_native
from dist_utils import load_impl, ref_impl, run_distributed
from models import Cfg, build_fsdp, make_mesh


def _check() -> None:
    cfg = Cfg()
    mesh = make_mesh(cfg)
    ours = list(build_fsdp(load_impl(), cfg, mesh).parameters())
    theirs = list(build_fsdp(ref_impl(), cfg, mesh).parameters())
    if load_impl().name == "fsdp_native":
        assert all(type(p) is fsdp_native.ShardedDTensor for p in ours)
    assert _has_foreach_support(ours, torch.device("cpu")), "ShardedDTensor parameters lack foreach support"
    assert _has_foreach_support(theirs, torch.device("cpu"))
    assert _default_to_fused_or_foreach(ours, False, False) == _default_to_fused_or_foreach(theirs, False, False)


def test_foreach_support_as_torch():
    run_distributed(_check, 2)
