"""Diffusion models from diffusers trained with Accelerate's FSDP2 plugin, as diffusers' training
scripts run them (``accelerate launch`` with ``fsdp_version: 2`` and transformer-based wrapping),
on fsdp_native through ``use_with_accelerate(cpu=True)`` against torch FSDP2, 2 CPU ranks, tiny
models built from configs (no Hub):

* a UNet2DConditionModel (Stable Diffusion's denoiser): its transformer and ResNet blocks as
  units, diffusers' own gradient checkpointing, and an EMA copy (``diffusers.training_utils.
  EMAModel``, ``foreach=True``) stepped on the sharded parameters after every optimizer step;
* a Flux transformer (joint and single-stream blocks) fine-tuned with LoRA through diffusers'
  ``add_adapter``: frozen base weights and trainable adapters in the same units;
* an SD3 transformer (joint blocks), fp32.

Each gives torch FSDP2's noise-prediction losses, trained parameters, EMA weights and
``Accelerator.get_state_dict`` bit for bit, with every unit the library's under test."""
from __future__ import annotations

import pytest

from dist_utils import full, full_params, run_distributed, run_grid
from test_hf_common import assert_same, check_adapters_trained, check_impl, impl_handle, reset_accelerate, set_launcher_env

pytest.importorskip("diffusers", reason="diffusers is a test dependency (make test installs it)")

STEPS = 3


def _model(kind: str):
    """A tiny diffusers model and the block classes Accelerate wraps as units."""
    import torch

    torch.manual_seed(0)
    if kind == "unet":
        from diffusers import UNet2DConditionModel

        model = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8,
        )
        return model, ["BasicTransformerBlock", "ResnetBlock2D"]
    if kind == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
        )
        return model, ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    )
    return model, ["JointTransformerBlock"]


def _batch(kind: str, rank: int, step: int):
    """This rank's model inputs (noisy latents, timesteps, text states) and the noise target."""
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    text = torch.randn(2, 5, 16, generator=g)
    if kind == "unet":
        latents = torch.randn(2, 4, 8, 8, generator=g)
        inputs = dict(sample=latents, timestep=torch.randint(0, 1000, (2,), generator=g), encoder_hidden_states=text)
    elif kind == "flux":  # packed 4 x 4 latents of 8 channels, one row of ids per token
        latents = torch.randn(2, 16, 8, generator=g)
        inputs = dict(
            hidden_states=latents, encoder_hidden_states=text, pooled_projections=torch.randn(2, 16, generator=g),
            timestep=torch.rand(2, generator=g), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), guidance=None,
        )
    else:
        latents = torch.randn(2, 4, 8, 8, generator=g)
        inputs = dict(
            hidden_states=latents, encoder_hidden_states=text, pooled_projections=torch.randn(2, 16, generator=g),
            timestep=torch.randint(0, 1000, (2,), generator=g),
        )
    return inputs, torch.randn(latents.shape, generator=g)


def _train(impl: str, kind: str, mixed_precision: str, checkpointing=False, ema=False, lora=False) -> dict:
    import torch
    import torch.distributed as dist

    reset_accelerate()
    rank = dist.get_rank()
    out = {}
    with impl_handle(impl):
        from accelerate import Accelerator, FullyShardedDataParallelPlugin

        model, blocks = _model(kind)
        if checkpointing:
            model.enable_gradient_checkpointing()
        if lora:  # diffusers' LoRA training scripts: the base frozen, adapters on the attention
            from peft import LoraConfig

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=blocks,
            reshard_after_forward=True,
        )
        acc = Accelerator(fsdp_plugin=plugin, mixed_precision=mixed_precision)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = acc.prepare(model, opt)
        check_impl(model, impl)
        if lora:
            out["initial"] = full_params(model)
        if ema:
            from diffusers.training_utils import EMAModel

            ema_model = EMAModel(model.parameters(), decay=0.9, foreach=True)
        losses = []
        for step in range(STEPS):
            inputs, target = _batch(kind, rank, step)
            pred = model(**inputs, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), target)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            if ema:
                ema_model.step(model.parameters())
            losses.append(loss.detach().clone())
        out["losses"] = losses
        out["params"] = full_params(model)
        if ema:
            out["ema"] = {str(i): full(t).detach().clone() for i, t in enumerate(ema_model.shadow_params)}
        out["state_dict"] = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        acc.free_memory()
    return out


def _parity(kind: str, mixed_precision: str = "no", **kw) -> None:
    ref = _train("torch", kind, mixed_precision, **kw)
    got = _train("native", kind, mixed_precision, **kw)
    assert len(got["losses"]) == STEPS
    for what in ref:
        assert_same(what, got[what], ref[what])
    if kw.get("lora"):  # A and B on q, k, v and out of the joint block, on q, k and v of the single-stream one
        check_adapters_trained(f"fsdp_native ({kind})", got["params"], got["initial"], adapters=2 * (4 + 3))


def _grid() -> None:
    set_launcher_env()
    configs = [
        dict(kind="unet", mixed_precision="bf16", checkpointing=True, ema=True),
        dict(kind="flux", mixed_precision="bf16", lora=True),
        dict(kind="sd3"),
    ]
    run_grid(configs, _parity, name="diffusers")


def test_diffusers_accelerate_fsdp2_ws2():
    run_distributed(_grid, 2, timeout=400)
