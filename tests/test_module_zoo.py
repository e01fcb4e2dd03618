"""torch.nn modules beyond Linear, as vision, audio and sequence models use them, each in units
of their own: 4-D convolution weights (dims 0 of 3 and 5 channels, padded over 2 ranks),
BatchNorm, whose running statistics are buffers updated in the forward and not sharded, a
``weight_norm`` parametrization (the parameters ``original0`` / ``original1`` are what FSDP
shards; the weight is computed from the gathered ones), ``nn.MultiheadAttention`` (its parent
module reads ``in_proj_weight`` and its child ``out_proj``'s parameters directly), and torch's
own ``nn.TransformerEncoderLayer``, recurrent layers (``nn.LSTM`` and ``nn.GRU`` keep a list of
their weights, ``_flat_weights``, that must follow the gathered parameters), and
``spectral_norm``, whose forward pre-hook updates its ``weight_u`` / ``weight_v`` buffers by power
iteration from the gathered ``weight_orig``. Training steps, then an ``eval()`` forward under
``no_grad`` (where the encoder layer may take its fused path). Bit for bit torch FSDP2's:
losses, evaluation output, parameters and buffers, in fp32 and with a bf16 policy (there each
BatchNorm is an fp32 unit of its own, nested in its block's unit, as with torch FSDP2: a bf16
BatchNorm would meet its fp32 running statistics, which FSDP does not cast; likewise each
spectral-normed Linear, with fp32 compute between bf16 input and output)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_close, assert_same_run, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from models import train_steps

EXACT = dict(rtol=0, atol=0)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(3, 5, 3, stride=2), nn.BatchNorm2d(5), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(5, 1)

    def units(self):
        return [self.stem, self.body]

    def forward(self, x):  # x: (batch, 4) -> a 1-channel 4x4 image
        return self.head(self.body(self.stem(x.view(-1, 1, 2, 2).repeat(1, 1, 2, 2))).flatten(1))


class NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(6, 10))
        self.bn = nn.BatchNorm1d(10)
        self.b = nn.Linear(10, 6)

    def forward(self, x):
        return x + self.b(torch.relu(self.bn(self.a(x))))


class WeightNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([NormedBlock(), NormedBlock()])
        self.out = nn.Linear(6, 1)

    def units(self):
        return list(self.blocks)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 1)

    def units(self):
        return [self.mha, self.enc]

    def forward(self, x):  # x: (batch, 4): a sequence of 3 tokens per sample
        h = self.inp(x).unsqueeze(1).expand(-1, 3, -1) * torch.arange(1, 4).view(1, 3, 1)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.out(self.enc(h)).mean(1)


class RecurrentNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, num_layers=2, batch_first=True)
        self.gru = nn.GRU(6, 5, batch_first=True, bidirectional=True)
        self.out = nn.Linear(10, 1)

    def units(self):
        return [self.lstm, self.gru]

    def forward(self, x):  # x: (batch, 4): a sequence of 3 steps per sample
        h = x.unsqueeze(1) * torch.arange(1, 4, dtype=x.dtype).view(1, 3, 1)
        h = self.gru(self.lstm(h)[0])[0]
        return self.out(h[:, -1])


class SpectralNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.sn = nn.Sequential(nn.utils.spectral_norm(nn.Linear(6, 8)), nn.ReLU(), nn.utils.spectral_norm(nn.Linear(8, 6)))
        self.out = nn.Linear(6, 1)

    def units(self):
        return [self.sn]

    def forward(self, x):
        return self.out(self.sn(self.inp(x)))


MODELS = {"conv": ConvNet, "weight_norm": WeightNormNet, "attention": AttentionNet, "recurrent": RecurrentNet,
          "spectral_norm": SpectralNet}


def _run(impl, model: str, mp: bool) -> dict:
    torch.manual_seed(0)
    m = MODELS[model]()
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
    if mp:  # BatchNorm in fp32 units of its own, as FSDP2 users do: its running stats stay fp32
        for bn in [x for x in m.modules() if isinstance(x, (nn.BatchNorm1d, nn.BatchNorm2d))]:
            impl.fully_shard(bn)
        # spectral_norm's power iteration multiplies its fp32 buffers with the weight: fp32
        # units of their own that take and give bf16, as a user keeps them
        fp32 = impl.MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
        for sn in [x for x in m.modules() if hasattr(x, "weight_u")]:
            impl.fully_shard(sn, mp_policy=fp32)
    for u in m.units():
        impl.fully_shard(u, **kw)
    impl.fully_shard(m, **kw)
    losses = train_steps(m, steps=3, batch=6)
    m.eval()
    with torch.no_grad():
        evaluation = m(torch.randn(6, 4, generator=torch.Generator().manual_seed(20 + dist.get_rank()))).float()
    m.train()
    return dict(losses=losses, params=full_params(m), evaluation=evaluation,
                buffers={n: b.clone() for n, b in m.named_buffers()})


def _body(model: str, mp: bool) -> None:
    ours, theirs = _run(load_impl(), model, mp), _run(ref_impl(), model, mp)
    what = f"[{model}, mp {mp}]"
    assert_same_run(what, ours, theirs)
    assert_close(f"{what} eval() forward", ours["evaluation"], theirs["evaluation"], EXACT)
    assert ours["buffers"].keys() == theirs["buffers"].keys(), f"{what} buffers {sorted(ours['buffers'])} vs {sorted(theirs['buffers'])}"
    for n, b in theirs["buffers"].items():
        assert_close(f"{what} buffer {n}", ours["buffers"][n], b, EXACT)
    if model in ("conv", "weight_norm"):  # the running statistics moved away from their initial values
        assert any(n.endswith("running_mean") and b.abs().sum() > 0 for n, b in ours["buffers"].items()), what


def _check() -> None:
    run_grid(grid(model=list(MODELS), mp=[False, True]), _body)


def test_module_zoo_matches_torch():
    run_distributed(_check, 2)


class Transposed(nn.Module):
    """A weight stored transposed (strides (1, 8)), as a tied or imported weight can be."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8).t())

    def forward(self, x):
        return x @ self.w


class ChannelsLastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 4, 3))
        self.proj = Transposed()
        self.out = nn.Linear(6, 1)

    def forward(self, x):  # x: (batch, 4) -> a 3-channel 6x6 image, channels last
        img = x.repeat(1, 27)[:, :108].view(-1, 3, 6, 6).contiguous(memory_format=torch.channels_last)
        return self.out(torch.tanh(self.proj(self.convs(img).flatten(1)[:, :8])))


def _non_contiguous_body() -> None:
    torch.manual_seed(0)
    model = ChannelsLastNet().to(memory_format=torch.channels_last)
    assert not model.convs[0].weight.is_contiguous() and not model.proj.w.is_contiguous()
    ref = ChannelsLastNet()
    ref.load_state_dict(model.state_dict())
    impl = load_impl()
    impl.fully_shard(model.convs)
    impl.fully_shard(model.proj)
    impl.fully_shard(model)
    ws, rank = dist.get_world_size(), dist.get_rank()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(10 + r) for r in range(ws)]
    for step in range(3):
        xs = [torch.randn(6, 4, generator=g) for g in gens]
        loss = model(xs[rank]).pow(2).mean()
        loss.backward()
        ref_loss = torch.stack([ref(x).pow(2).mean() for x in xs])
        ref_loss.mean().backward()
        assert_close(f"step {step} loss", loss.detach(), ref_loss[rank].detach(), dict(rtol=1e-6, atol=1e-6))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    ours = full_params(model)
    for n, p in ref.named_parameters():
        assert_close(f"parameter {n}", ours[n], p.detach(), dict(rtol=1e-6, atol=1e-6))


def test_non_contiguous_parameters_match_unsharded():
    """Parameters that are not contiguous (channels-last convolution weights, a transposed
    weight): torch FSDP2 (2.11-2.15) refuses them with ``NotImplementedError``; fsdp_native
    shards them as contiguous tensors, and trains them as an unsharded model does."""
    run_distributed(_non_contiguous_body, 2)
