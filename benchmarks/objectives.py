"""Forward + backward time of every objective against GRPO on the same [64, 1024] tensors.

    .venv/bin/python benchmarks/objectives.py [--repeats 50] [--out benchmarks/results/objectives.json]

Times are medians over repeats, interleaved round-robin so machine noise hits every objective alike;
printed as ratios to GRPO within this one run. Goal: P3O <= 1.10x GRPO.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lit_ess.objectives import OBJECTIVE_CLASSES


def make_inputs(B=64, T=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    lb = -torch.rand(B, T, generator=g) * 4
    lp = (lb + 0.2 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return lp, lb, adv, mask


def time_once(obj, lp, lb, adv, mask) -> float:
    t0 = time.perf_counter()
    out = obj(lp, lb, adv, mask)
    out.loss.backward()
    lp.grad = None
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/objectives.json")
    a = p.parse_args(argv)
    lp, lb, adv, mask = make_inputs(a.B, a.T)
    objs = {cls.name: cls() for cls in OBJECTIVE_CLASSES}
    times = {name: [] for name in objs}
    for _ in range(5):                                   # warm-up
        for name, obj in objs.items():
            time_once(obj, lp, lb, adv, mask)
    for _ in range(a.repeats):
        for name, obj in objs.items():
            times[name].append(time_once(obj, lp, lb, adv, mask))
    base = statistics.median(times["grpo"])
    print(f"fwd+bwd on [{a.B}, {a.T}] float32, {a.repeats} repeats, torch threads {torch.get_num_threads()}")
    print(f"{'objective':10s} {'median ms':>10s} {'x GRPO':>8s}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:10s} {m * 1e3:10.2f} {m / base:8.2f}")
    ratios = {name: statistics.median(ts) / base for name, ts in times.items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "command": "python benchmarks/objectives.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "B": a.B, "T": a.T, "repeats": a.repeats, "torch_threads": torch.get_num_threads(),
        "median_s": {name: statistics.median(ts) for name, ts in times.items()}, "ratio_to_grpo": ratios,
        "goal_p3o_ratio_max": 1.10}, indent=1) + "\n")
    print(f"written: {a.out}")
    return ratios


if __name__ == "__main__":
    main()
