"""Lightning's FSDP2 path, ``ModelParallelStrategy``, in Fabric and in the Trainer.

Fabric's ``ModelParallelStrategy`` (the user's
``parallelize_fn`` calls ``fully_shard`` on the strategy's ``data_parallel`` mesh) with
fsdp_native's ``fully_shard`` in place of torch's, the one-import change, on 2 CPU ranks:
``fabric.no_backward_sync`` for gradient accumulation (it calls
``set_requires_gradient_sync(..., recurse=False)`` on every FSDP module),
``fabric.clip_gradients``, and ``fabric.save`` / ``fabric.load`` of the model, optimizer and
step (DCP through ``get_model_state_dict`` / ``get_optimizer_state_dict``). The losses and
parameters are torch FSDP2's bit for bit, and a run resumed from the step-2 checkpoint ends
where the uninterrupted one did, whichever library saved and whichever loaded. Also Fabric's
2-D case, FSDP with tensor parallelism, on 4 ranks.

The Trainer's (``lightning.pytorch``): a ``LightningModule`` whose ``configure_model`` calls
``fully_shard`` on ``self.device_mesh["data_parallel"]``, trained by ``Trainer.fit`` with
``accumulate_grad_batches``, ``gradient_clip_val``, a ``ModelCheckpoint`` at each epoch's end
and ``fit(ckpt_path=...)`` resuming from epoch 0's: the same comparisons.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from dist_utils import ctx, full_params, run_distributed, run_grid
from models import ResidualMLP
from test_hf_common import assert_same, set_launcher_env

# The version the test was written and run against (the Makefile installs it).
LIGHTNING_VERSION = "2.6.6"

DIM, STEPS, ACCUM, SAVE_AT = 16, 4, 2, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualMLP(DIM, 2 * DIM) for _ in range(3)])
        self.head = nn.Linear(DIM, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _fabric_env():
    """What torchrun sets, so that Fabric joins the existing process group as a torchelastic run."""
    set_launcher_env()
    os.environ.update(GROUP_RANK="0", TORCHELASTIC_RUN_ID="fsdp-native-test")


def _run(lib: str, policy: bool, precision: str, save_dir: str | None = None, resume: str | None = None):
    """STEPS optimizer steps of ACCUM micro-batches; ``save_dir``: fabric.save after step
    SAVE_AT; ``resume``: fabric.load first. Returns (micro-batch losses, full parameters)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    if lib == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_native import MixedPrecisionPolicy, fully_shard

    def parallelize(model, mesh):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else MixedPrecisionPolicy()
        for b in model.blocks:
            fully_shard(b, mesh=mesh["data_parallel"], mp_policy=mp)
        fully_shard(model, mesh=mesh["data_parallel"], mp_policy=mp)
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt, "step": 0}
    if resume:
        fabric.load(resume, state)
    gen = torch.Generator().manual_seed(7 + fabric.global_rank)
    data = [(torch.randn(4, DIM, generator=gen), torch.randn(4, 5, generator=gen)) for _ in range(STEPS * ACCUM)]
    losses = []
    for step in range(state["step"], STEPS):
        for m in range(ACCUM):
            x, y = data[step * ACCUM + m]
            with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                loss = (model(x).float() - y).pow(2).mean()
                fabric.backward(loss)
            losses.append(loss.detach().clone())
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        state["step"] = step + 1
        if save_dir and state["step"] == SAVE_AT:
            fabric.save(save_dir, state)
    from torch.distributed.fsdp import FSDPModule

    from fsdp_native import FSDPModule as NativeFSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    native = [isinstance(m, NativeFSDPModule) for m in units]
    assert native == [lib == "native"] * 4, f"{lib}: FSDP units {native} (True: fsdp_native's), expected 4 of {lib}'s"
    return losses, full_params(model)


def _parity(policy: bool, precision: str):
    base = os.path.join(ctx().tmpdir, f"lightning-{policy}-{precision}")
    full = {lib: _run(lib, policy, precision, save_dir=os.path.join(base, lib)) for lib in ("torch", "native")}
    assert len(full["torch"][0]) == STEPS * ACCUM
    assert_same("losses", full["native"][0], full["torch"][0])
    assert_same("parameters", full["native"][1], full["torch"][1])
    done = SAVE_AT * ACCUM
    for lib, saver in (("native", "native"), ("native", "torch"), ("torch", "native")):
        got = _run(lib, policy, precision, resume=os.path.join(base, saver))
        what = f"{lib} resumed from {saver}'s step-{SAVE_AT} checkpoint"
        assert_same(f"{what}: losses", got[0], full["torch"][0][done:])
        assert_same(f"{what}: parameters", got[1], full["torch"][1])


def _grid():
    _fabric_env()
    run_grid(
        [
            dict(policy=False, precision="32-true"),
            dict(policy=True, precision="32-true"),  # bf16 compute, fp32 reduction (MixedPrecisionPolicy)
            dict(policy=False, precision="bf16-mixed"),  # Fabric's autocast
        ],
        _parity,
        name="fabric",
    )


def _tp_run(lib: str, policy: bool):
    """Fabric's 2-D case on 4 ranks: each block's fc1 column-wise and fc2 row-wise over
    ``tensor_parallel``, then ``fully_shard`` over ``data_parallel``. No gradient clipping:
    the head's parameters are on the data-parallel mesh alone, the blocks' on both, and
    ``clip_grad_norm_`` cannot stack norms from two meshes (torch FSDP2 fails the same way)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if lib == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_native import MixedPrecisionPolicy, fully_shard

    def parallelize(model, mesh):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else MixedPrecisionPolicy()
        for b in model.blocks:
            parallelize_module(b, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(b, mesh=mesh["data_parallel"], mp_policy=mp)
        fully_shard(model, mesh=mesh["data_parallel"], mp_policy=mp)
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    # Both ranks of a tensor-parallel group take the same batch.
    gen = torch.Generator().manual_seed(7 + strategy.device_mesh["data_parallel"].get_local_rank())
    losses = []
    for _ in range(3):
        for m in range(ACCUM):
            x, y = torch.randn(4, DIM, generator=gen), torch.randn(4, 5, generator=gen)
            with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                loss = (model(x).float() - y).pow(2).mean()
                fabric.backward(loss)
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return losses, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _tp_parity(policy: bool):
    ref, got = _tp_run("torch", policy), _tp_run("native", policy)
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])


def _tp_grid():
    _fabric_env()
    run_grid([dict(policy=False), dict(policy=True)], _tp_parity, name="fabric fsdp+tp")


def test_fabric_fsdp_and_tensor_parallel_ws4():
    run_distributed(_tp_grid, 4, timeout=300)


def _trainer_run(lib: str, policy: bool, precision: str, ckpt_dir: str | None = None, resume: str | None = None):
    """Two epochs of two optimizer steps (ACCUM micro-batches each); ``ckpt_dir``: a
    checkpoint at each epoch's end; ``resume``: ``fit(ckpt_path=resume)``."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    if lib == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_native import MixedPrecisionPolicy, fully_shard

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = Net()
            self.losses = []

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else MixedPrecisionPolicy()
            for b in self.model.blocks:
                fully_shard(b, mesh=mesh, mp_policy=mp)
            fully_shard(self.model, mesh=mesh, mp_policy=mp)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = (self.model(x).float() - y).pow(2).mean()
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(3)
    n = 2 * 4 * ACCUM * 2  # ranks x batch x accumulation x steps: one epoch
    data = torch.utils.data.TensorDataset(torch.randn(n, DIM, generator=gen), torch.randn(n, 5, generator=gen))
    callbacks = []
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=2,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0,
        precision=precision,
        callbacks=callbacks,
        enable_checkpointing=bool(ckpt_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=ctx().tmpdir,
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=resume)
    assert trainer.global_step == 4, trainer.global_step
    return module.losses, full_params(module.model)


def _trainer_parity(policy: bool, precision: str):
    base = os.path.join(ctx().tmpdir, f"lightning-trainer-{policy}-{precision}")
    full = {lib: _trainer_run(lib, policy, precision, ckpt_dir=os.path.join(base, lib)) for lib in ("torch", "native")}
    assert len(full["torch"][0]) == 4 * ACCUM
    assert_same("losses", full["native"][0], full["torch"][0])
    assert_same("parameters", full["native"][1], full["torch"][1])
    for lib, saver in (("native", "native"), ("native", "torch"), ("torch", "native")):
        ckpt = os.path.join(base, saver, "epoch=0-step=2.ckpt")
        got = _trainer_run(lib, policy, precision, resume=ckpt)
        what = f"{lib} resumed from {saver}'s epoch-0 checkpoint"
        assert_same(f"{what}: losses", got[0], full["torch"][0][2 * ACCUM :])
        assert_same(f"{what}: parameters", got[1], full["torch"][1])


def _trainer_grid():
    _fabric_env()
    run_grid(
        [dict(policy=False, precision="32-true"), dict(policy=True, precision="32-true"), dict(policy=False, precision="bf16-mixed")],
        _trainer_parity,
        name="trainer",
    )


def test_lightning_trainer_model_parallel_strategy_ws2():
    run_distributed(_trainer_grid, 2, timeout=300)


def test_installed_lightning_is_the_tested_one():
    from importlib.metadata import version

    assert version("lightning") == LIGHTNING_VERSION, (
        f"lightning {version('lightning')} installed; tests/test_lightning.py is pinned to {LIGHTNING_VERSION} (Makefile)"
    )


def test_fabric_model_parallel_strategy_ws2():
    run_distributed(_grid, 2, timeout=300)
