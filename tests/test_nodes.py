"""Two nodes on this machine through torchrun: `torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1}
--master_addr 127.0.0.1` with `--trainer.num_nodes 2 --trainer.devices 1`, FSDP2 on gloo. The 2-node run
is the 1-node 2-rank run: the same losses, ESS and exported weights."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e_utils import cli, pythonpath, rl_config, scalars, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.dist]

ENGINE = {"class_path": "lit_ess.engines.HFConfig", "init_args": {"batch_size": 8}}


def config(model_dir, out: Path, max_steps=3, **kw):
    """FSDP2 over 2 data-parallel ranks, the hf engine colocated, an export at the end."""
    cfg = rl_config(model_dir, out, prompts=8, samples=4, max_steps=max_steps, extra_data={"engine": ENGINE}, **kw)
    cfg["trainer"]["devices"] = 2
    cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                  "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
    cfg["trainer"]["callbacks"] += [{"class_path": "lit_ess.callbacks.FSDP2"},
                                    {"class_path": "lit_ess.callbacks.ExportHF", "init_args": {"dirpath": str(out / "export")}}]
    return write_config(cfg, out / "config.yaml")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(cfg: Path, out: Path, *extra: str) -> list[subprocess.Popen]:
    """The two node launchers, each in its own session, stderr to out/node{r}.txt."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=pythonpath(), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    procs = []
    for r in (0, 1):
        err = open(out / f"node{r}.txt", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(r),
             "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "lit_ess.cli", "fit", "--config", str(cfg),
             "--trainer.num_nodes", "2", "--trainer.devices", "1", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    return procs


def exported(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_two_nodes_equal_one_node_two_ranks(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    res = cli(["fit", "--config", str(config(tiny_model_dir, one))], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    procs = torchrun_nodes(config(tiny_model_dir, two), two)
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], [(two / f"node{r}.txt").read_text()[-3000:] for r in (0, 1)]
    a, b = scalars(one), scalars(two)
    for key in ("train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean", "train/tokens"):
        x, y = [v for _, v in a[key]], [v for _, v in b[key]]
        assert len(x) == len(y) == 3 and x == pytest.approx(y, rel=1e-5, abs=1e-5), (key, x, y)
    assert min(v for _, v in b["train/ess"]) >= 0.9999
    w1, w2 = exported(one / "export"), exported(two / "export")
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


def test_kill_9_of_node_1_stops_node_0_with_one_line_and_the_run_resumes_exactly(tiny_model_dir, tmp_path):
    """kill -9 of node 1's torchrun launcher after the checkpoint of step 4: its rank follows it (saying
    so), node 0's rank names node 1's rank in one line within 60 s, and no process of either node is left.
    Resumed with `--ckpt_path last` on two nodes, the run trains steps 5 and 6 as the uninterrupted run does."""
    import time

    from e2e_utils import session_processes

    out, ref = tmp_path / "run", tmp_path / "ref"
    procs = torchrun_nodes(config(tiny_model_dir, out, max_steps=400, ckpt_every=2), out)
    deadline = time.monotonic() + 400
    while not any((c / "meta.pt").exists() for c in (out / "ckpt").glob("*-step=4.ckpt")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [(out / f"node{r}.txt").read_text()[-2000:] for r in (0, 1)]
        time.sleep(0.2)
    os.kill(procs[1].pid, 9)
    t0 = time.monotonic()
    assert procs[0].wait(timeout=90) != 0
    assert time.monotonic() - t0 < 60
    time.sleep(2)
    assert session_processes(procs[0].pid) == [] and session_processes(procs[1].pid) == []
    ours = [line for line in (out / "node0.txt").read_text().splitlines() if line.startswith("lit-ess: error")]
    assert len(ours) == 1 and ours[0].startswith("lit-ess: error: node 1 rank 1 (pid ") and " died: this rank stops" \
        in ours[0], ours
    said = [line for line in (out / "node1.txt").read_text().splitlines() if line.startswith("lit-ess: error")]
    assert said and "the torchrun launcher of node 1" in said[0], said

    # resume both nodes from the last checkpoint, to step 6; the uninterrupted run of the same config to step 6
    done = max(int(c.name.split("step=")[1].split(".")[0]) for c in out.glob("ckpt/*-step=*.ckpt") if (c / "meta.pt").exists())
    for p in torchrun_nodes(config(tiny_model_dir, out, max_steps=done + 2, ckpt_every=2), out, "--ckpt_path", "last"):
        assert p.wait(timeout=600) == 0, (out / "node0.txt").read_text()[-3000:]
    res = cli(["fit", "--config", str(config(tiny_model_dir, ref, max_steps=done + 2))], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = scalars(out), scalars(ref)
    for key in ("train/loss", "train/ess", "rollout/reward_mean"):
        resumed = dict(a[key])                    # the resumed run's values replace the killed run's of the same step
        for step, v in b[key]:
            assert resumed[step] == pytest.approx(v, rel=1e-5, abs=1e-6), (key, step)
    w1, w2 = exported(out / "export"), exported(ref / "export")
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


SERVER = {"class_path": "lit_ess.engines.VLLMServerConfig", "init_args": {"max_model_len": 256, "heartbeat_seconds": None}}


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_two_nodes_async(tiny_model_dir, tmp_path, placement):
    """Async S = 1 on two torchrun nodes, FSDP2: each node's rank with its own worker process and hf engine
    (colocated), or one vLLM server that node 0's rank launches and both nodes' workers share, node 0 alone
    pushing the weights (dedicated). Both launchers exit 0, the lag stays within the bound, both ranks train
    different prompts, and no process of either node is left."""
    import re
    import time

    from e2e_utils import session_processes
    from test_dist import _records

    log = tmp_path / "server.log"
    engine = ENGINE if placement == "colocated" else \
        {**SERVER, "init_args": {**SERVER["init_args"], "log_file": str(log)}}
    data = {"engine": engine, "schedule": {"mode": "async", "placement": placement, "max_staleness": 1, "worker_timeout": 300}}
    cfg = rl_config(tiny_model_dir, tmp_path, prompts=8, samples=4, max_steps=3, extra_data=data)
    cfg["trainer"]["devices"] = 2
    cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                  "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
    cfg["trainer"]["callbacks"] += [{"class_path": "lit_ess.callbacks.FSDP2"},
                                    {"class_path": "e2e_utils.RecordPrompts", "init_args": {"path": str(tmp_path / "prompts.jsonl")}}]
    cfg = write_config(cfg, tmp_path / "config.yaml")
    procs = torchrun_nodes(cfg, tmp_path)
    codes = [p.wait(timeout=900) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"node{r}.txt").read_text()[-3000:] for r in (0, 1)]
    time.sleep(1)
    assert session_processes(procs[0].pid) == [] and session_processes(procs[1].pid) == []
    got = scalars(tmp_path)
    assert len(got["train/loss"]) == 3 and max(v for _, v in got["train/policy_lag_max"]) <= 1
    r0, r1 = _records(tmp_path / "prompts.jsonl"), _records(tmp_path / "prompts.jsonl.rank1")
    for a, b in zip(r0, r1, strict=True):
        assert not set(a["prompt_ids"]) & set(b["prompt_ids"]), "both nodes trained the same prompt"
    if placement == "dedicated":                  # one server: the label set once, then one reload per push
        text = log.read_text()
        assert len(re.findall(r"POST /update_weight_version", text)) >= 2
        assert len(re.findall(r"Uvicorn running on|Started server process", text)) == 1
