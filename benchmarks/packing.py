"""Training on tokens, not padding: one optimizer step's forward + backward, padded vs token budget vs packed.

Shape: `--rows` rows of a prompt (uniform in [--prompt-min, --prompt-max] tokens, default [8, 32]) and a completion whose length is drawn
from a lognormal (mu, sigma) clipped to [1, --max-new-tokens]: most completions short, a tail to the
limit, mean about a third of the limit (the drawn lengths, their mean and the share at the limit are in
the JSON; their histogram in benchmarks/results/packing_lengths.png). Model: a randomly initialised
Qwen2 from lit_ess.tiny (--hidden-size, --num-layers; sdpa attention, fp32), one torch thread.

The step's loss is L = -sum(lp * completion_mask) / N (N: the step's completion tokens), with lp from
  padded           lit_ess.logprobs.sequence_logprobs on the whole [B, T] (today's micro_batch_size: null)
  budget           the same on micro-batches of lit_ess.packing.plan_micro_batches(packed=False): rows
                   sorted by length, rows x longest row <= --micro-batch-tokens, each trimmed
  packed           lit_ess.packing.packed_logprobs on micro-batches of plan_micro_batches(packed=True)
                   (sum of lengths <= --micro-batch-tokens), each packed in lines as wide as its longest row
  packed_1xN       the same micro-batches, each packed in one [1, N] line (a dense N x N block-diagonal mask)
  packed_step      the whole step in one micro-batch, packed in lines as wide as its longest row (what
                   PolicyModule does with `packing: true` and no `micro_batch_tokens`)
  packed_one_line  the whole step packed in one [1, N] line (a dense N x N block-diagonal mask)
and gradients accumulated over micro-batches. Time: median wall seconds over --rounds, the variants
interleaved round-robin so slow phases of the shared machine hit them alike (after a warm-up round and
the memory round).
Peak memory: the process's RSS high-water mark during one step of each variant (VmHWM reset to the
current RSS just before, /proc/self/clear_refs 5, freed heap returned to the OS first) minus the RSS
just before: what the step's activations and gradients add. Ratios are variant / padded of one run. The
loss and gradient norm of every variant are checked against the padded one (rel 1e-4).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py

Writes benchmarks/results/packing.json and packing_lengths.png (`--out NAME`: NAME.json, NAME_lengths.png).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.memory import _release_freed, _status_kib
from lit_ess.logprobs import sequence_logprobs
from lit_ess.packing import pack, packed_logprobs, plan_micro_batches

RESULTS = Path(__file__).parent / "results"


def draw_batch(rows: int, max_new: int, mu: float, sigma: float, vocab: int, seed: int, prompt_range=(8, 32)):
    """input_ids, attention_mask [B, T], completion_mask [B, T] and the completion lengths [B]."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_range[0], prompt_range[1] + 1, (rows,), generator=g)
    comp = torch.exp(mu + sigma * torch.randn(rows, generator=g)).round().clamp(1, max_new).long()
    T = int((prompts + comp).max())
    ids = torch.randint(4, vocab, (rows, T), generator=g)
    cols = torch.arange(T)[None]
    mask = (cols < (prompts + comp)[:, None]).long()
    cmask = (cols >= prompts[:, None]) & mask.bool()
    return ids * mask, mask, cmask, comp


def micro_batches(mask: torch.Tensor, budget: int | None, packed: bool) -> list[list[int]]:
    lengths = mask.sum(-1).tolist()
    return [list(range(len(lengths)))] if budget is None else plan_micro_batches(lengths, budget, packed)


def step(model, ids, mask, cmask, plan, packed: bool, line: bool) -> float:
    """Forward + backward of the step over the micro-batches of `plan`; returns the loss."""
    N = cmask.sum()
    total = 0.0
    for rows in plan:
        w = int(mask[rows].sum(-1).max())
        i, m, c = ids[rows, :w], mask[rows, :w], cmask[rows, :w]
        if packed:
            lp, _ = packed_logprobs(model, i, m, c, width=None if line else w)
        else:
            lp, _ = sequence_logprobs(model, i, m, c)
        loss = -(lp * c).sum() / N
        loss.backward()
        total += loss.detach().item()
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mu", type=float, default=3.3)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=10)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--out", default="packing", help="result name under benchmarks/results/")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from lit_ess.tiny import HEAD_DIM, build_tiny_model

    load_start = os.getloadavg()
    heads = a.hidden_size // HEAD_DIM
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(Path(d) / "m", hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=heads,
                                num_kv_heads=heads, intermediate_size=4 * a.hidden_size,
                                max_position_embeddings=2 * (a.prompt_max + a.max_new_tokens) + 64)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    params = sum(x.numel() for x in model.parameters())
    ids, mask, cmask, comp = draw_batch(a.rows, a.max_new_tokens, a.mu, a.sigma, model.config.vocab_size, a.seed,
                                      (a.prompt_min, a.prompt_max))
    variants = {
        "padded": (micro_batches(mask, None, False), False, False),
        "budget": (micro_batches(mask, a.micro_batch_tokens, False), False, False),
        "packed": (micro_batches(mask, a.micro_batch_tokens, True), True, False),
        "packed_1xN": (micro_batches(mask, a.micro_batch_tokens, True), True, True),
        "packed_one_line": (micro_batches(mask, None, True), True, True),
        "packed_step": (micro_batches(mask, None, True), True, False),
    }

    def run(name):
        plan, packed, line = variants[name]
        model.zero_grad(set_to_none=True)
        loss = step(model, ids, mask, cmask, plan, packed, line)
        gnorm = float(torch.cat([x.grad.flatten() for x in model.parameters() if x.grad is not None]).norm())
        return loss, gnorm

    for name in variants:                                   # warm-up: kernels' first-call allocations
        run(name)
    checks, peaks = {}, {}
    for name in variants:                                   # correctness, peak memory
        model.zero_grad(set_to_none=True)
        _release_freed()
        before = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")        # VmHWM := current RSS
        checks[name] = run(name)
        peaks[name] = _status_kib("VmHWM") - before
    ref_loss, ref_norm = checks["padded"]
    for name, (loss, gnorm) in checks.items():
        if not (math.isclose(loss, ref_loss, rel_tol=1e-4) and math.isclose(gnorm, ref_norm, rel_tol=1e-4)):
            raise SystemExit(f"{name}: loss {loss} / grad norm {gnorm} differ from padded {ref_loss} / {ref_norm}")
    times = {name: [] for name in variants}
    for _ in range(a.rounds):
        for name in variants:
            t = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t)

    lengths = mask.sum(-1)
    tokens = int(lengths.sum())
    out = {
        "machine": {"node": platform.node(), "cpu": _cpu_name(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg(), "torch": torch.__version__},
        "model": {"params": params, "hidden_size": a.hidden_size, "num_layers": a.num_layers,
                  "attn_implementation": "sdpa", "dtype": "float32"},
        "shape": {"rows": a.rows, "prompt_range": [a.prompt_min, a.prompt_max], "max_new_tokens": a.max_new_tokens, "lognormal_mu": a.mu, "lognormal_sigma": a.sigma,
                  "completion_mean": float(comp.float().mean()), "completion_mean_over_max": float(comp.float().mean()) / a.max_new_tokens,
                  "share_at_limit": float((comp == a.max_new_tokens).float().mean()),
                  "tokens": tokens, "padded_tokens": int(mask.numel()), "micro_batch_tokens": a.micro_batch_tokens,
                  "completion_lengths": comp.tolist()},
        "memory_method": "RSS high-water mark (VmHWM reset via /proc/self/clear_refs) minus RSS before the step, KiB",
        "variants": {},
    }
    for name, (plan, packed, line) in variants.items():
        widths = [int(lengths[r].max()) for r in plan]
        held = sum(pack(ids[r, :w], mask[r, :w], None if line else w).input_ids.numel() if packed else len(r) * w
                   for r, w in zip(plan, widths))                  # packed: lines x width, their tails included
        med = statistics.median(times[name])
        out["variants"][name] = {
            "micro_batches": len(plan), "tokens_held": held, "seconds": times[name], "median_s": med,
            "time_vs_padded": med / statistics.median(times["padded"]),
            "peak_rss_kib": peaks[name], "peak_vs_padded": peaks[name] / peaks["padded"],
            "loss": checks[name][0], "grad_norm": checks[name][1]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(out, indent=1))
    _histogram(comp, a.max_new_tokens, RESULTS / f"{a.out}_lengths.png")
    for name, v in out["variants"].items():
        print(f"{name:16s} {v['micro_batches']:3d} mb  {v['median_s']:7.2f} s  x{v['time_vs_padded']:.2f}  "
              f"peak {v['peak_rss_kib'] / 1024:7.1f} MiB  x{v['peak_vs_padded']:.2f}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _histogram(comp: torch.Tensor, max_new: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(comp.tolist(), bins=range(0, max_new + 9, 8))
    ax.axvline(float(comp.float().mean()), color="k", ls="--", label=f"mean {float(comp.float().mean()):.0f}")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("rows")
    ax.set_title(f"{len(comp)} rows, limit {max_new}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
