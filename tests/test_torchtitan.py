"""torchtitan's own FSDP2 code path, with fsdp_native in place of torch FSDP2, against torch FSDP2
on 2 gloo ranks: torchtitan 0.3.0's Llama 3 debug model built on the meta device from its
model registry, parallelized by its ``parallelize_llama`` (``apply_fsdp_to_decoder``: a unit per
block, ``fully_shard([norm, lm_head])`` without resharding after forward, the root, gradient
division off, bf16 compute with fp32 reduction, its selective activation checkpointing),
``to_empty`` and ``init_weights`` on the sharded model, then its training step: the chunked
loss (``ChunkedLossWrapper``: the head called once per sequence chunk with its own backward,
gradient sync off but for the last chunk), the loss divided by the global token count,
``dist_utils.clip_grad_norm_``, its AdamW and warmup schedule.

The swap is the one a user makes: torchtitan's ``distributed/fsdp.py`` imports ``fully_shard``,
``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and ``DataParallelMeshDims`` from fsdp_native.
Both of torchtitan's DTensor backends: ``partial_dtensor`` (FSDP on the data-parallel mesh)
and ``full_dtensor`` (parameters DTensors on the full SPMD mesh, ``fully_shard(...,
dp_mesh_dims=...)``). Its default, ``spmd_types``, needs a torch whose ``fully_shard`` turns
spmd_types annotations into DTensors (torch 2.13, which this runs on, raises for it, as for
fsdp_native).

torchtitan assumes an accelerator: its device type is pointed at the CPU, and the debug model's
flex attention (no backward on CPU) is swapped for SDPA, as torchtitan's own graph-trainer
tests do. torch FSDP2 on gloo gets ``set_force_sum_reduction_for_comms(True)`` (with gradient
division off it would use ``PREMUL_SUM``, which gloo lacks; the sums are the same).

Losses, gradient norms, placements and every parameter after 3 steps: bit for bit.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_same_run, full_params, load_impl, placements_of, ref_impl, run_distributed, run_grid

pytest.importorskip("torchtitan", reason="torchtitan is a test dependency (make test installs it)")

SEQ, BATCH, VOCAB = 64, 2, 2048


@contextlib.contextmanager
def _torchtitan_fsdp(impl):
    """torchtitan's FSDP names bound to `impl`'s: the user's one-import change."""
    import torchtitan.distributed.fsdp as tt_fsdp

    names = ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "DataParallelMeshDims")
    saved = {n: getattr(tt_fsdp, n) for n in names}
    for n in names:
        setattr(tt_fsdp, n, getattr(impl.module, n))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(tt_fsdp, n, v)


def _cpu_device() -> None:
    import torchtitan.distributed.parallel_dims as tt_dims
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = tt_dims.device_type = "cpu"


def _train(impl, backend: str) -> dict:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed import full_dtensor
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    _cpu_device()
    ws = dist.get_world_size()
    cfg = llama3_debugmodel()
    cfg.model_spec = spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    for layer in spec.model.layers:  # torchtitan's graph-trainer tests' SDPA swap
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, BATCH
    cfg.parallelism.data_parallel_shard_degree = ws
    cfg.parallelism.spmd_backend = backend
    dist_utils.set_spmd_backend(backend)
    spec.model.update_from_config(config=cfg)
    dims = ParallelDims.from_config(cfg.parallelism, ws)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    with _torchtitan_fsdp(impl):
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=cfg.training,
            parallelism=cfg.parallelism,
            compile_config=cfg.compile,
            ac_config=cfg.activation_checkpoint,
            dump_folder="",
        )
    units = [m for m in model.modules() if isinstance(m, impl.FSDPModule)]
    # the embedding, 2 blocks, norm and lm_head (one unit of two modules) and the root
    assert len(units) == 6, f"{impl.name}: {len(units)} modules sharded"
    if impl.name == "torch":
        for m in units:
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = cfg.optimizer.build(model_parts=[model])
    schedulers = cfg.lr_scheduler.build(optimizers=optimizers, training_steps=cfg.training.steps)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses, norms = [], []
    for _ in range(3):  # torchtitan's Trainer.train_step, one microbatch
        optimizers.zero_grad()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        extra = {"positions": torch.arange(SEQ).expand(BATCH, SEQ)}
        global_tokens = dist_utils.dist_sum_tensor((labels != -100).sum(), dims.get_mesh("batch"))
        if backend == "full_dtensor":
            inputs, labels, extra = full_dtensor.parallelize_inputs(dims, inputs, labels, extra)
        pred = model(inputs, **extra)
        loss, _ = loss_fn(pred, labels, global_tokens, positions=extra["positions"])
        loss.backward()
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), cfg.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return dict(losses=losses, norms=norms, params=full_params(model), placements=placements_of(model))


def _check(backend: str) -> None:
    impl = load_impl()
    ref, got = _train(ref_impl(), backend), _train(impl, backend)
    assert_same_run(f"[{impl.name} vs torch, torchtitan {backend}]", got, ref)


def _grid() -> None:
    run_grid([dict(backend="partial_dtensor"), dict(backend="full_dtensor")], _check, name="torchtitan")


def test_torchtitan_llama3_parallelize_and_train_step_match_torch():
    run_distributed(_grid, 2)
