"""NVIDIA NeMo Automodel's FSDP2 code on fsdp_native against torch FSDP2, 2 gloo ranks.

* ``fsdp2_strategy_parallelize`` (``nemo_automodel/components/distributed/parallelizer.py``),
  its entry point for Hugging Face models, on a tiny ``LlamaForCausalLM``: a unit per decoder
  layer, the embedding, the LM head and the root, its explicit forward and backward prefetch,
  with and without its activation checkpointing; fp32, and bf16 parameters with fp32
  reduction; on 4 ranks, HSDP (2 replicas of 2 shards) and FSDP x its tensor parallel plan
  (2 x 2). fsdp_native goes where the module imported ``fully_shard`` from torch
  (``parallelizer.fully_shard``). Unit names, losses and parameters after 3 steps: bit for bit.
* Its mixture-of-experts mixin (``nemo_automodel/components/moe/fsdp_mixin.py``) on a model
  with the layout it walks (``model.layers[i].mlp.experts`` units): gradient accumulation with
  ``prepare_for_grad_accumulation`` / ``prepare_for_final_backward``, and its pipeline path,
  ``_run_post_backward_for_moe_module``, which finishes the backward through torch's
  ``fully_shard.state(module)`` (every state's ``_fsdp_param_group.post_backward()``, then
  ``_root_post_backward_final_callback()``; ``tests/test_torch_state.py`` has that protocol
  on every torch). Losses and parameters: bit for bit.

NeMo Automodel 0.7.0 pins transformers 5.18 and brings Megatron-FSDP and CUDA packages; ``make
venv`` installs the package alone, without dependencies, into ``.venv/nemo-automodel-site``,
which only these ranks put on their path. The modules used import with ``.venv``'s packages.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dist_utils import assert_same_run, framework_site, full_params, load_impl, ref_impl, run_distributed, run_grid

SITE = framework_site("FSDP_NEMO_AUTOMODEL_SITE", "nemo-automodel-site", "nemo_automodel", "NeMo Automodel")
STEPS = 3


def _llama_run(impl, mp: bool, ac: bool, mesh_shape: tuple[int, int, int] | None = None) -> dict:
    """``mesh_shape``: (dp_replicate, dp_shard_cp, tp), NeMo Automodel's mesh; (1, world size, 1)
    by default."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import nemo_automodel.components.distributed.parallelizer as parallelizer

    parallelizer.fully_shard = impl.fully_shard
    mesh_shape = mesh_shape or (1, dist.get_world_size(), 1)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    policy = impl.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else impl.mp()
    model = parallelizer.fsdp2_strategy_parallelize(model, mesh, mp_policy=policy, activation_checkpointing=ac)
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        logits = model(input_ids=ids).logits
        if isinstance(logits, DTensor):  # tensor parallelism: its plan leaves the logits sharded over tp
            logits = logits.full_tensor()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model), units=units)


def _llama(mp: bool, ac: bool, mesh_shape: tuple[int, int, int] | None = None) -> None:
    got, ref = _llama_run(load_impl(), mp, ac, mesh_shape), _llama_run(ref_impl(), mp, ac, mesh_shape)
    assert got["units"] == ref["units"] == ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"], got["units"]
    assert_same_run(f"fsdp2_strategy_parallelize, mp {mp}, activation checkpointing {ac}, mesh {mesh_shape}", got, ref)


def _moe_run(impl, mp: bool, flow: str) -> dict:
    from nemo_automodel.components.moe import fsdp_mixin
    from test_torch_state import VOCAB, CausalLM, shard

    class MoECausalLM(CausalLM, fsdp_mixin.MoEFSDPSyncMixin):
        pass

    torch.manual_seed(0)
    model = shard(impl, MoECausalLM(), mp)
    model.backend = type("Backend", (), {"enable_fsdp_optimizations": True})()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        model.prepare_for_grad_accumulation()
        for micro in range(2):
            if flow == "final" and micro == 1:
                model.prepare_for_final_backward()
            tokens = torch.randint(0, VOCAB, (5,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(tokens).float(), torch.roll(tokens, 1))
            loss.backward()
            losses.append(loss.item())
        if flow == "pipeline":
            fsdp_mixin._run_post_backward_for_moe_module(model)
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model))


def _moe(mp: bool, flow: str) -> None:
    got, ref = _moe_run(load_impl(), mp, flow), _moe_run(ref_impl(), mp, flow)
    assert_same_run(f"MoEFSDPSyncMixin, {flow} flow, mp {mp}", got, ref)
    if flow == "pipeline":  # the two flows give the same numbers
        assert_same_run("pipeline against final", got, _moe_run(load_impl(), mp, "final"))


def _grid(site: str) -> None:
    sys.path.insert(0, site)
    run_grid([dict(mp=False, ac=False), dict(mp=True, ac=True)], _llama, name="parallelize")
    run_grid([dict(mp=False, flow="final"), dict(mp=True, flow="pipeline")], _moe, name="moe")


def test_nemo_automodel_fsdp2_matches_torch():
    run_distributed(_grid, 2, SITE, timeout=600)


def _grid_4(site: str) -> None:
    sys.path.insert(0, site)
    run_grid([dict(mp=True, ac=False, mesh_shape=(2, 2, 1)), dict(mp=True, ac=False, mesh_shape=(1, 2, 2))], _llama, name="parallelize")


def test_nemo_automodel_hsdp_and_tensor_parallel_match_torch():
    run_distributed(_grid_4, 4, SITE, timeout=600)
