"""The examples as a user launches them: torchrun, as separate processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# two torchruns of 2 ranks on the 2-core machine, 3 eager steps: 50 s under a load of 4; 240 s. In the slow tier:
# the default run trains the same composition (dynashard over mesh["tp"], DDP over mesh["dp"]) on 4 spawned
# ranks against the twin in test_training_2d.py; this adds the launch (torchrun's rendezvous, the mesh from env)
DEADLINE_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 30)
def test_train_2d_on_two_nodes_equals_the_unsharded_model():
    """examples/train_2d.py as README "Several machines" launches it on two nodes: two torchruns of 2
    processes meeting at a c10d rendezvous on localhost, a 2x2 mesh (a node per replica, tp inside it, FSDP2
    across: the script's default); the replicas' mean loss equals the unsharded twin's at every step (the
    script exits 1 past 1e-4)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"train2d{port}",
           os.path.join(ROOT, "examples", "train_2d.py"), "--compiler", "eager", "--steps", "3"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=DEADLINE_S))
    finally:
        for node in nodes:
            node.kill()
    printed = "".join(out for out, _ in outs)
    assert all(node.returncode == 0 for node in nodes), printed[-2000:] + "".join(err[-3000:] for _, err in outs)
    assert "mesh dp=2 x tp=2, fsdp2" in printed and "largest relative difference" in printed, printed[-2000:]
