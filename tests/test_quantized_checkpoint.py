"""DCP checkpoints of models with quantized all-gathers: save after some steps, load into a
model built from other weights (which has trained a step of its own, so its optimizer state
and any scale state are stale), train on: the losses are bit for bit the uninterrupted run's.

* torchao Float8 training (``enable_fsdp_float8_all_gather``, precomputed scales, bf16 mixed
  precision): the weights are ``WeightWithDynamicFloat8CastTensor`` inside DTensors; saved by
  fsdp_native and resumed by torch FSDP2, the other way round, and fsdp_native to fsdp_native;
  also with tensor parallelism (2 x 2, torchao's Float8 TP styles: DTensors over dp x tp).
* fsdp_native's own quantized all-gather (fp8 tensorwise / rowwise, NF4 on frozen blocks):
  the checkpoint holds the full-precision shards, and the all-gathers after the load quantize
  the loaded values (nothing quantized is kept across the load).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from dist_utils import assert_close, load_impl, ref_impl, run_distributed, run_grid
from models import copy_task, mesh_of

pytest.importorskip("torchao", reason="torchao is a test dependency (make test installs it)")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: E402

EXACT = dict(rtol=0, atol=0)


def _resume(build_save, build_load, train, path: str) -> tuple[list[float], list[float]]:
    """build_*(seed) -> (model, optim); train(model, optim, steps, seed) -> losses. Returns the
    uninterrupted run's losses after the save and the resumed run's."""
    model, opt = build_save(0)
    train(model, opt, 3, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    want = train(model, opt, 2, 7)

    model, opt = build_load(1)
    train(model, opt, 1, 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return want, train(model, opt, 2, 7)


# --------------------------------------------------------------------- torchao Float8


def _float8_builder(impl, tp: bool = False):
    """With `tp`: 2 data-parallel ranks x 2 TP ranks, torchao's Float8 TP styles
    (test_float8._parallelize): the weights' DTensors over dp x tp hold Float8 local tensors."""
    import test_float8 as f8

    def build(seed):
        torch.manual_seed(seed)
        model = f8.Model()
        cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "head")
        mesh = mesh_of("1d")
        if tp:
            full_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            f8._parallelize(model, full_mesh["tp"], sp=False)
            mesh = full_mesh["dp"]
        mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            impl.fully_shard(b, mesh=mesh, mp_policy=mp)
        impl.fully_shard(model, mesh=mesh, mp_policy=mp)
        assert type(model.blocks[0].fc1.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    return build


def _float8_train(model, opt, steps: int, seed: int) -> list[float]:
    import test_float8 as f8

    precompute_float8_dynamic_scale_for_fsdp(model)  # the scales of the (possibly just loaded) weights
    # the TP ranks of a data-parallel rank share its batch
    dp_rank = model.head.weight.device_mesh.get_local_rank()
    gen = torch.Generator().manual_seed(seed + dp_rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(32, f8.DIM, generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def _check_float8(save: str, load: str, root: str, tp: bool = False) -> None:
    impls = {"fsdp_native": load_impl(), "torch": ref_impl()}
    path = os.path.join(root, f"float8-{save}-{load}")
    want, got = _resume(_float8_builder(impls[save], tp), _float8_builder(impls[load], tp), _float8_train, path)
    assert_close(f"[Float8{' + TP' if tp else ''} saved by {save}, resumed by {load}] losses", got, want, EXACT)


def _float8_grid(root: str, tp: bool = False) -> None:
    pairs = [("fsdp_native", "torch"), ("torch", "fsdp_native"), ("fsdp_native", "fsdp_native")]
    run_grid([dict(save=s, load=l, root=root, tp=tp) for s, l in pairs], _check_float8, name="float8-dcp")


def test_float8_checkpoint_across_libraries(tmp_path):
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native against torch FSDP2")
    run_distributed(_float8_grid, 2, str(tmp_path))


def test_float8_tensor_parallel_checkpoint_across_libraries(tmp_path):
    """torchtitan's Float8 + TP + FSDP layout (2 x 2): DCP checkpoints of the Float8 DTensors
    over dp x tp, across the two libraries."""
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native against torch FSDP2")
    run_distributed(_float8_grid, 4, str(tmp_path), True)


# --------------------------------------------- fsdp_native's own quantized all-gather


def _check_own(fmt: str, root: str) -> None:
    import test_quantized_all_gather as qag

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    frozen = fmt == "nf4"

    def build(seed):
        model = qag._build(fmt, mesh, frozen_blocks=frozen, seed=seed)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def train(model, opt, steps, seed):
        return copy_task(model, opt, qag.ARGS, steps, torch.Generator().manual_seed(seed + dist.get_rank()))

    want, got = _resume(build, build, train, os.path.join(root, fmt))
    assert_close(f"[{fmt} all-gather, resumed] losses", got, want, EXACT)


def _own_grid(root: str) -> None:
    run_grid([dict(fmt=f, root=root) for f in ("fp8_tensorwise", "fp8_rowwise", "nf4")], _check_own, name="quant-dcp")


def test_own_quantized_all_gather_checkpoint_resume(tmp_path):
    if load_impl().name != "fsdp_native":
        pytest.skip("fsdp_native's own feature")
    run_distributed(_own_grid, 2, str(tmp_path))
