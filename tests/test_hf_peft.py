"""PEFT LoRA fine-tuning through the Transformers Trainer with FSDP2 (the fsdp_config of the
Hugging Face FSDP2 docs), a tiny Llama from a LlamaConfig (no Hub) on 2 CPU ranks:

* fsdp_native against torch FSDP2 in the same spawn, fp32 and bf16: bitwise equal losses and
  parameters; the frozen base weights are unchanged and every adapter trained; the adapter
  files that ``Trainer.save_model`` writes are bitwise equal;
* QLoRA-style with fsdp_native's NF4 all-gather for the frozen base weights
  (``use_with_accelerate(all_gather=QuantizedAllGather("nf4"))``): the decoder layers gather NF4
  for the base weights and full precision for the adapters and norms, training follows the
  unquantized run's losses, and the saved adapters are the trained full-precision ones.
"""
from __future__ import annotations

import os

import pytest

from dist_utils import ctx, run_distributed, run_grid
from test_hf_common import assert_same, set_launcher_env

pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")


def _adapters(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _initial_params(dtype: str | None = None) -> dict:
    import torch

    from test_hf_trainer import lora_llama

    model = lora_llama()
    if dtype is not None:
        model.to(getattr(torch, dtype))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_trained(what: str, params: dict, init: dict) -> None:
    import torch

    assert params.keys() == init.keys(), sorted(set(params) ^ set(init))
    lora = [n for n in init if "lora_" in n]
    assert len(lora) == 2 * 4 * 2, lora  # A and B of 4 projections in each of 2 layers
    for n, v in init.items():
        same = torch.equal(params[n].to(v.dtype), v)
        assert same != (n in lora), f"{what}: {n!r} {'did not change' if same else 'changed'} (frozen: {n not in lora})"


def _parity(bf16: bool, model_dtype: str | None = None) -> None:
    import torch.distributed as dist

    from test_hf_trainer import trainer_run

    dirs = {impl: os.path.join(ctx().tmpdir, f"peft-{impl}-{bf16}") for impl in ("torch", "native")}
    ref = trainer_run("torch", lora=True, bf16=bf16, save_dir=dirs["torch"], model_dtype=model_dtype)
    got = trainer_run("native", lora=True, bf16=bf16, save_dir=dirs["native"], model_dtype=model_dtype)
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])
    _check_trained("fsdp_native", got[1], _initial_params(model_dtype))
    dist.barrier()
    saved = {impl: _adapters(d) for impl, d in dirs.items()}
    assert saved["native"] and all("lora_" in k for k in saved["native"]), sorted(saved["native"])
    assert_same("saved adapters", saved["native"], saved["torch"])


def _nf4() -> None:
    import torch.distributed as dist

    import fsdp_native
    from test_hf_accelerate import _gathers
    from test_hf_trainer import trainer_run

    batch = __import__("test_hf_common").token_batches(1, bsz=2)[0]
    seen = {}
    plain = trainer_run("native", lora=True, on_trained=lambda t: seen.update(plain=_gathers(t.model, batch)))
    save_dir = os.path.join(ctx().tmpdir, "peft-nf4")
    quant = trainer_run(
        "native",
        lora=True,
        all_gather=fsdp_native.QuantizedAllGather("nf4", min_numel=256),
        save_dir=save_dir,
        on_trained=lambda t: seen.update(nf4=_gathers(t.model, batch)),
    )
    layers = {u: v for u, v in seen["nf4"].items() if ".layers." in u}
    assert len(layers) == 2 and all(f == "nf4" for f, _ in layers.values()), seen["nf4"]
    for u, (_, nbytes) in layers.items():
        # fp32 base weights as NF4 (about 0.14x), adapters and norms in fp32: 0.25x measured.
        assert nbytes <= 0.30 * seen["plain"][u][1], (u, nbytes, seen["plain"][u][1])
    worst = max(abs(a.item() - b.item()) for a, b in zip(quant[0], plain[0]))
    assert worst < 0.05, f"nf4: losses differ from the unquantized run's by {worst:.4f}: {quant[0]} vs {plain[0]}"
    _check_trained("fsdp_native with NF4 all-gather", quant[1], _initial_params())
    dist.barrier()
    saved = _adapters(save_dir)
    want = {k: v for k, v in quant[1].items() if "lora_" in k}
    assert len(saved) == len(want), (sorted(saved), sorted(want))
    for k, v in saved.items():  # PEFT drops the adapter name from the keys it saves
        match = [w for n, w in want.items() if n.replace(".default", "") == k]
        assert len(match) == 1, (k, sorted(want))
        assert_same(f"saved adapter {k!r}", v, match[0])


def _grid() -> None:
    set_launcher_env()
    run_grid([dict(bf16=False), dict(bf16=True), dict(bf16=True, model_dtype="bfloat16")], _parity, name="peft")
    run_grid([{}], lambda: _nf4(), name="peft nf4")


def test_peft_lora_trainer_ws2():
    run_distributed(_grid, 2, timeout=400)
