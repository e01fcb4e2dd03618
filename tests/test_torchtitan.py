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

torchtitan's Qwen3 MoE debug model (4 ranks, ``partial_dtensor``) takes the same path with its
expert-parallel branch of ``apply_fsdp_to_decoder``: experts on ``Shard(1)`` where there are
fewer of them than FSDP x EP ranks, and with expert parallelism a ``shard_placement_fn`` that
returns torch's ``ShardPlacementResult`` naming the ``efsdp`` mesh (torch 2.13+), plus its
explicit prefetch; tokens reach the experts through its all-to-all dispatcher, and
``clip_grad_norm_`` runs its expert-parallel branch. (Its ``full_dtensor`` backend with expert
parallelism fails in torch FSDP2 itself on torch 2.13: "Expected param's DTensor mesh to be
the same mesh passed to fully_shard".)

Losses, gradient norms, placements and every parameter after 3 steps: bit for bit.
"""
from __future__ import annotations

import contextlib
import importlib

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


def _config(model: str, experts: int):
    """torchtitan's debug config of `model`, cut to 2 blocks; a MoE's experts cut to `experts`."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "llama3":
        from torchtitan.models.llama3 import model_registry
        from torchtitan.models.llama3.config_registry import llama3_debugmodel as debug_config

        cfg, spec = debug_config(), model_registry("debugmodel")
    else:
        from torchtitan.models.qwen3 import model_registry
        from torchtitan.models.qwen3.config_registry import qwen3_moe_debug as debug_config

        cfg, spec = debug_config(), model_registry("debugmodel_moe")
    cfg.model_spec = spec
    spec.model.layers = spec.model.layers[:2]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # see the module docstring
        moe = getattr(layer, "moe", None)
        if moe is not None and experts:
            moe.num_experts = moe.router.num_experts = moe.router.gate.out_features = experts
            moe.routed_experts.inner_experts.num_experts = moe.routed_experts.token_dispatcher.num_experts = experts
            moe.router.top_k = moe.routed_experts.token_dispatcher.top_k = min(experts, 2)
    return cfg, spec


def _train(impl, backend: str, model: str = "llama3", ep: int = 1, replicate: int = 1, experts: int = 0) -> dict:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed import full_dtensor

    _cpu_device()
    ws = dist.get_world_size()
    cfg, spec = _config(model, experts)
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, BATCH
    cfg.parallelism.data_parallel_replicate_degree = replicate
    cfg.parallelism.data_parallel_shard_degree = ws // replicate
    cfg.parallelism.expert_parallel_degree = ep
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
    if ep > 1:  # the experts' own mesh: fsdp_native took torchtitan's per-parameter placements
        experts_w = model.layers["0"].moe.routed_experts.inner_experts.w1_EFD
        assert experts_w.device_mesh.mesh_dim_names[-2:] == ("efsdp", "ep"), f"{impl.name}: {experts_w.device_mesh}"
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
        norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), cfg.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=ep > 1
        )
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return dict(losses=losses, norms=norms, params=full_params(model), placements=placements_of(model))


def _check(backend: str, **moe) -> None:
    impl = load_impl()
    ref, got = _train(ref_impl(), backend, **moe), _train(impl, backend, **moe)
    assert_same_run(f"[{impl.name} vs torch, torchtitan {backend} {moe}]", got, ref)


def _grid() -> None:
    run_grid([dict(backend="partial_dtensor"), dict(backend="full_dtensor")], _check, name="torchtitan")


def test_torchtitan_llama3_parallelize_and_train_step_match_torch():
    run_distributed(_grid, 2)


def _moe_grid() -> None:
    moe = dict(backend="partial_dtensor", model="qwen3_moe", experts=2)
    run_grid(
        [
            dict(moe, experts=8),  # 8 experts over 4 ranks: Shard(0), as dense parameters
            dict(moe),  # 2 experts over 4 ranks: torchtitan puts them on Shard(1)
            dict(moe, ep=2),  # experts on (efsdp 2, ep 2), the rest on fsdp 4; Shard(1) again
            dict(moe, ep=2, replicate=2, experts=4),  # HSDP 2 x 2; experts on (dp_replicate, efsdp 1, ep 2)
        ],
        _check,
        name="torchtitan MoE",
    )


@pytest.mark.skipif(
    not hasattr(importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common"), "ShardPlacementResult"),
    reason="torchtitan's expert parallelism needs torch FSDP2's per-parameter mesh (torch 2.13+)",
)
def test_torchtitan_qwen3_moe_expert_parallel_matches_torch():
    run_distributed(_moe_grid, 4)
