"""Multi-node training through torchrun, the way fsdp_native scales past one machine: two
torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on one host standing in
for two machines) start 4 ranks whose RANK, LOCAL_RANK and GROUP_RANK differ, and
``tests/multinode_train.py`` trains with torch FSDP2 and with fsdp_native over all 4 ranks and
as HSDP (each node a replica, sharded over its local ranks). fsdp_native's losses and
parameters must be torch FSDP2's bit for bit, fp32 and bf16 with fp32 reduction."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_match_torch_fsdp2(tmp_path):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fsdp-native-multinode",
           os.path.join(HERE, "multinode_train.py"), str(tmp_path)]  # fmt: skip
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = []
    for a in agents:
        try:
            outs.append(a.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outs)

    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    envs = sorted((r["env"]["GROUP_RANK"], r["env"]["LOCAL_RANK"], r["env"]["RANK"]) for r in results)
    assert [(g, l) for g, l, _ in envs] == [(0, 0), (0, 1), (1, 0), (1, 1)], envs
    for r in results:
        # The replicate groups of the HSDP mesh join the same local rank of the two nodes.
        assert len(r["hsdp_replicate_ranks"]) == 2, r["hsdp_replicate_ranks"]
        for layout in ("1d", "hsdp"):
            for mp in (False, True):
                ref, got = r[("torch", layout, mp)], r[("fsdp_native", layout, mp)]
                what = f"rank {r['env']['RANK']} {layout} bf16={mp}"
                assert got["placements"] == ref["placements"], f"{what}: placements {got['placements']} vs {ref['placements']}"
                assert torch.equal(got["losses"], ref["losses"]), f"{what}: losses {got['losses']} vs {ref['losses']}"
                bad = [n for n in ref["params"] if not torch.equal(got["params"][n], ref["params"][n])]
                assert not bad, f"{what}: parameters {bad} differ"
