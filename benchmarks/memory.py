"""Memory per rank of a training step: 1 rank (plain policy) vs 2 gloo ranks with FSDP2.

Each configuration runs in fresh processes (torch.multiprocessing spawn); with 2 ranks, a gloo
process group on 127.0.0.1, a 1-D device mesh of the ranks, `lit_ess.callbacks.FSDP2().shard` on the
policy (fp32, no mixed precision: only the sharding differs). Each rank builds the PolicyModule
(`configure_model`), an AdamW over its (local) parameters as `configure_optimizers` groups them, and
runs a few optimizer steps (`accumulate_gradients`, clipping, AdamW) on its share of one synthetic
global batch (16 rows x 64 tokens: 8 rows a rank with 2 ranks). Per rank it measures

  (a) state bytes: parameters + gradients + AdamW state the rank actually holds, the sum of local
      shard sizes (`to_local()` of each DTensor), taken after the last step, before zero_grad;
  (b) peak RSS of the steps: the high-water mark (VmHWM) reset to the current RSS just before the
      first step (`/proc/self/clear_refs` 5), so the full model that every rank loads before sharding
      does not count; also the baseline RSS after imports (Python + torch + transformers runtime,
      which no sharding reduces) and the whole process's peak (ru_maxrss, model load included).

Ratios are 2-rank / 1-rank of one run. Goal: (a) about halves (<= 0.6).

    PYTHONPATH=. .venv/bin/python benchmarks/memory.py [--steps 3 --rows 16 --tokens 64]

Writes benchmarks/results/memory.json.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from lit_ess.settings import Optim

RESULTS = Path(__file__).parent / "results" / "memory.json"
SMALL_25M = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1536)


def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _release_freed() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so RSS is what is held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (local shards only;
    tied parameters counted once)."""
    params = {id(p): p for p in model.parameters()}.values()
    out = {"params": sum(_local_bytes(p) for p in params),
           "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
           "optimizer": sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor))}
    out["total"] = sum(out.values())
    return out


def make_batch(vocab: int, rows: int, tokens: int, prompt: int = 8, seed: int = 0):
    """A synthetic global batch: `rows` x `tokens`, the first `prompt` tokens of each row a prompt."""
    from lit_ess.sampling import SamplingConfig
    from lit_ess.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, tokens), generator=g)
    comp = torch.zeros(rows, tokens, dtype=torch.bool)
    comp[:, prompt:] = True
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=comp,
                        behavior_logprobs=torch.where(comp, -torch.rand(rows, tokens, generator=g) * 5, 0.0),
                        advantages=torch.randn(rows, generator=g), rewards=torch.zeros(rows),
                        versions=torch.zeros(rows, dtype=torch.long), prompt_ids=torch.arange(rows),
                        prompt_texts=[""] * rows, completion_texts=[""] * rows,
                        sampling=SamplingConfig(max_new_tokens=tokens - prompt),
                        max_staleness=10**9)


def _worker(rank: int, world: int, port: int, model_dir: str, rows: int, tokens: int, steps: int,
            threads: int, results) -> None:
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from lit_ess.callbacks.fsdp import FSDP2
    from lit_ess.module import PolicyModule

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    _release_freed()
    baseline = _status_kib("VmRSS")                     # runtime: interpreter, torch, transformers, gloo

    module = PolicyModule(model_dir, optim=Optim(lr=1e-4, weight_decay=0.01))
    module.configure_model()
    policy = module.policy
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        FSDP2().shard(policy, init_device_mesh("cpu", (world,)))
    # configure_optimizers' parameter groups (it needs an attached Trainer for the schedule)
    named = list(policy.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-4)
    batch = make_batch(policy.config.vocab_size, rows, tokens)
    mine = batch.select(list(range(rank, rows, world)))     # this rank's rows of the global batch

    _release_freed()
    before_steps = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")        # VmHWM := current RSS
    losses, grad_norms, held = [], [], None
    for _ in range(steps):
        metrics, _ = module.accumulate_gradients(mine)
        grad_norms.append(float(module._clip_and_norm()))
        opt.step()
        held = state_bytes(policy, opt)                 # params + grads + AdamW moments, all present now
        opt.zero_grad(set_to_none=True)
        losses.append(metrics["train/loss"])
    peak = _status_kib("VmHWM")
    results[rank] = {"state_bytes": held, "rss_baseline_kib": baseline, "rss_before_steps_kib": before_steps,
                     "rss_peak_steps_kib": peak, "rss_peak_steps_over_baseline_kib": peak - baseline,
                     "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                     "rows": mine.rows, "losses": losses, "grad_norms": grad_norms,
                     "num_params": sum(p.numel() for p in {id(p): p for p in policy.parameters()}.values())}
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, model_dir: str, rows: int = 16, tokens: int = 64, steps: int = 3,
            threads: int = 1) -> list[dict]:
    """Per-rank measurements of `world` fresh processes (world 1: plain policy, no process group)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        results = mgr.dict()
        mp.start_processes(_worker, args=(world, _free_port(), model_dir, rows, tokens, steps, threads, results),
                           nprocs=world, start_method="spawn")
        return [dict(results[r]) for r in range(world)]


def _mib(kib_or_bytes: float, unit: str = "kib") -> float:
    return kib_or_bytes / 1024 if unit == "kib" else kib_or_bytes / 2**20


# glibc keeps freed heap blocks for reuse, so RSS counts memory FSDP2 has already freed (its per-layer
# all-gather and reduce-scatter buffers); with large blocks mmapped (freed at once) RSS follows live memory.
ALLOCATORS = {"glibc default": {}, "glibc mmap >= 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def _ratios(one: list[dict], two: list[dict]) -> dict[str, float]:
    """2-rank / 1-rank, the larger of the two ranks."""
    def worst(f):
        return max(f(r) for r in two) / f(one[0])

    return {"state_bytes": worst(lambda r: r["state_bytes"]["total"]),
            "rss_peak_steps": worst(lambda r: r["rss_peak_steps_kib"]),
            "rss_peak_steps_over_baseline": worst(lambda r: r["rss_peak_steps_over_baseline_kib"]),
            "ru_maxrss": worst(lambda r: r["ru_maxrss_kib"])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")     # inherited by the spawned ranks
    from lit_ess.tiny import build_tiny_model

    runs = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(build_tiny_model(d + "/m25", **SMALL_25M))
        for alloc, env in ALLOCATORS.items():
            saved = dict(os.environ)
            os.environ.update(env)                      # read by glibc when each spawned rank starts
            try:
                runs[alloc] = {"one_rank": measure(1, model_dir, a.rows, a.tokens, a.steps),
                               "two_ranks_fsdp2": measure(2, model_dir, a.rows, a.tokens, a.steps)}
            finally:
                os.environ.clear()
                os.environ.update(saved)
            runs[alloc]["env"] = env
            runs[alloc]["ratios"] = _ratios(runs[alloc]["one_rank"], runs[alloc]["two_ranks_fsdp2"])
    n = runs["glibc default"]["one_rank"][0]["num_params"]
    print(f"model {n / 1e6:.1f}M parameters (fp32), global batch {a.rows} x {a.tokens} tokens split over the ranks, "
          f"{a.steps} AdamW steps, torch threads 1 per rank. MiB per rank:")
    print(f"{'allocator':21s} {'config':14s} {'rank':>4s} {'params':>7s} {'grads':>7s} {'AdamW':>7s} {'state':>7s} "
          f"{'RSS base':>9s} {'RSS peak':>9s} {'peak-base':>9s} {'maxrss':>8s}")
    for alloc, res in runs.items():
        for label, key in (("1 rank", "one_rank"), ("2 ranks FSDP2", "two_ranks_fsdp2")):
            for r, m in enumerate(res[key]):
                s = m["state_bytes"]
                print(f"{alloc:21s} {label:14s} {r:4d} {_mib(s['params'], 'b'):7.1f} {_mib(s['grads'], 'b'):7.1f} "
                      f"{_mib(s['optimizer'], 'b'):7.1f} {_mib(s['total'], 'b'):7.1f} "
                      f"{_mib(m['rss_baseline_kib']):9.1f} {_mib(m['rss_peak_steps_kib']):9.1f} "
                      f"{_mib(m['rss_peak_steps_over_baseline_kib']):9.1f} {_mib(m['ru_maxrss_kib']):8.1f}")
    print("ratio 2 ranks / 1 rank (larger rank):")
    for alloc, res in runs.items():
        q = res["ratios"]
        print(f"  {alloc:21s} state {q['state_bytes']:.3f} (goal <= 0.6), peak RSS of the steps "
              f"{q['rss_peak_steps']:.3f}, its increase over the runtime baseline "
              f"{q['rss_peak_steps_over_baseline']:.3f}, whole-process peak {q['ru_maxrss']:.3f}")
    result = {"num_params": n, "rows": a.rows, "tokens": a.tokens, "steps": a.steps, "goal_state_ratio_max": 0.6,
              "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
