"""An exponential moving average of the weights, kept the FSDP2 way (``copy.deepcopy`` and
``swa_utils.AveragedModel`` refuse a sharded module, in torch as here): a list of sharded
DTensor copies of the parameters, updated after every optimizer step with
``torch._foreach_lerp_``, and swapped into the model with ``p.copy_`` for an evaluation,
then swapped back. The writes go to the parameters' local shards, so the next all-gather must
see them. As in torch FSDP2, the root unit stays unsharded after a forward (its
``reshard_after_forward`` is None), so ``model.reshard()`` comes before the writes; without
it, both libraries evaluate the root's stale unsharded weights.

Checked: each evaluation with the averaged weights equals an unsharded copy of the model loaded
with them, bit for bit; the swap back restores the trained model's output; and bit for bit
torch FSDP2's evaluations, losses and final parameters, with and without a bf16 policy."""
import torch
import torch.distributed as dist

from dist_utils import assert_close, assert_same_run, full, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack


def _run(impl, mp: bool) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(lambda: ResidualMLP(6, 10), dim=6, n=2), mp=mp)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    ema = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    probe = torch.ones(2, 4)
    torch.manual_seed(0)
    plain = BlockStack(lambda: ResidualMLP(6, 10), dim=6, n=2)  # the unsharded reference
    if mp:
        plain.to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    losses, ema_evals = [], []
    for _ in range(4):
        loss = model(torch.randn(4, 4, generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 0.1)
            trained = model(probe).float()
            backup = [p.detach().clone() for p in params]
            model.reshard()
            for p, e in zip(params, ema):
                p.copy_(e)
            averaged = model(probe).float()
            plain.load_state_dict({n: full(e) for n, e in zip(names, ema)})
            expected = plain(probe.to(torch.bfloat16) if mp else probe).float()
            assert_close("the evaluation with the averaged weights, against an unsharded model", averaged, expected, dict(rtol=0, atol=0))
            model.reshard()
            for p, b in zip(params, backup):
                p.copy_(b)
            assert not torch.equal(averaged, trained), "the evaluation did not see the averaged weights"
            assert_close("the model after the weights were swapped back", model(probe).float(), trained, dict(rtol=0, atol=0))
        ema_evals.append(averaged)
    return dict(losses=losses, params=full_params(model), ema_evals=torch.stack(ema_evals))


def _body(mp: bool) -> None:
    ours, theirs = _run(load_impl(), mp), _run(ref_impl(), mp)
    assert_close(f"[mp {mp}] evaluations with the averaged weights", ours["ema_evals"], theirs["ema_evals"], dict(rtol=0, atol=0))
    assert_same_run(f"[mp {mp}]", ours, theirs)


def _check() -> None:
    run_grid(grid(mp=[False, True]), _body)


def test_ema_weights_swapped_in_for_evaluation_as_torch():
    run_distributed(_check, 2)
