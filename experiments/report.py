"""The results page and plots, made from the runs' CSV files (never typed by hand).

For each experiment: a PNG of training reward, held-out pass@1 and ESS against the optimizer step
(mean over seeds, the band spans min..max), and a table per cell: final held-out pass@1 (mean +- std
over seeds), its change from the warm start, the training reward of the last 10% of steps, the mean
ESS, and the seeds that collapsed. A seed collapsed when its final held-out pass@1 is more than
COLLAPSE below the warm start's, or its run failed; for each such seed the page lists what its logs
show at the worst step (ESS, largest ratio, KL to pi_b, response length), the place to start
reading the mechanism.
"""
from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

from .cells import EXPERIMENTS, Scale, temperature

COLLAPSE = 0.10
CURVES = [("rollout/reward_mean", "training reward (sampled)"), ("val/pass@1", "held-out pass@1"),
          ("train/ess", "ESS e_B")]


def read_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    return {k: sorted(v) for k, v in out.items()}


def _runs(out: Path, exp: str, cell: str, seeds: int) -> tuple[list[dict], int]:
    """The finished seeds' scalars, and the number of failed seeds."""
    runs, failed = [], 0
    for s in range(seeds):
        d = out / exp / cell / f"seed{s}"
        if (d / "done.json").exists():
            runs.append({"seed": s, **read_csv(d / "metrics.csv")})
        elif (d / "failed.txt").exists():
            failed += 1
    return runs, failed


def _final(run: dict, tag: str) -> float | None:
    return run[tag][-1][1] if run.get(tag) else None


def _last_frac(run: dict, tag: str, frac: float = 0.1) -> float | None:
    vals = [v for _, v in run.get(tag, [])]
    if not vals:
        return None
    k = max(1, int(len(vals) * frac))
    return sum(vals[-k:]) / k


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def _diagnosis(run: dict) -> str:
    """What the logs show at the step with the lowest ESS (and overall extremes)."""
    ess = run.get("train/ess", [])
    if not ess:
        return "no train/ess logged"
    step, low = min(ess, key=lambda p: p[1])
    at = {tag: dict(run.get(tag, [])).get(step) for tag in ("train/ratio_max", "train/kl_behavior",
                                                            "rollout/response_len", "train/grad_norm")}
    kl_max = max((v for _, v in run.get("train/kl_behavior", [])), default=float("nan"))
    parts = [f"lowest ESS {low:.3f} at step {step}"]
    parts += [f"{t.split('/')[1]} {v:.3g}" for t, v in at.items() if v is not None]
    parts.append(f"max kl_behavior over the run {kl_max:.3g}")
    reward = [v for _, v in run.get("rollout/reward_mean", [])]
    if reward:
        parts.append(f"training reward {reward[0]:.2f} -> {reward[-1]:.2f}")
    return ", ".join(parts)


def _base(out: Path, temp: float) -> dict:
    d = out / "_base" / ("val" if temp == 1.0 else f"val_T{temp}")
    base = read_csv(d / "metrics.csv")
    if _final(base, "val/pass@1") is None:
        raise ValueError(f"{d / 'metrics.csv'} holds no val/pass@1: delete it and rerun")
    return base


def plot(out: Path, exp, runs_by_cell: dict[str, list[dict]], bases: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES) + 2.5, 3.8))
    colors = {cell: plt.cm.tab20(i % 20) for i, cell in enumerate(runs_by_cell)}   # distinct up to 20 cells
    for ax, (tag, label) in zip(axes, CURVES):
        for cell, runs in runs_by_cell.items():
            series = [dict(r.get(tag, [])) for r in runs]
            if tag == "val/pass@1":                    # step 0: the warm start at this cell's temperature
                series = [{0: bases[cell], **s} for s in series]
            steps = sorted(set().union(*[set(s) for s in series])) if series else []
            steps = [t for t in steps if all(t in s for s in series)]
            if not steps:
                continue
            vals = [[s[t] for s in series] for t in steps]
            mean = [statistics.mean(v) for v in vals]
            ax.plot(steps, mean, label=cell, color=colors[cell], marker="o" if tag == "val/pass@1" else None, ms=3)
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=colors[cell], alpha=0.15)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(exp.title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1 - 2.5 / (5 * len(CURVES) + 2.5), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, results: Path, names: list[str], scale: Scale, command: str) -> Path:
    """Write `results/results.md` and `results/img/experiments/<exp>.png`; return the page's path."""
    base_pass = _final(_base(out, 1.0), "val/pass@1")
    img_dir = results / "img" / "experiments"
    seconds = sum(json.loads(p.read_text())["seconds"] for p in out.rglob("done.json"))
    lines = [
        "# Results: the paper's experiments at CPU scale",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from the runs in "
        f"`{out.relative_to(out.parents[1]) if len(out.parents) > 1 else out}`; never edited by hand.",
        "",
        f"Every run: the same warm-started tiny model (1.8M-parameter Qwen2, supervised for {scale.sft_steps} "
        f"steps on 2-digit addition with 30% wrong labels), {scale.prompts} prompts x {scale.samples} samples per "
        f"rollout, 8 new tokens, lr 2e-4, {scale.steps} optimizer steps, {scale.seeds} seed(s) per cell. Held out: "
        f"{scale.val_prompts} sums that no training prompt contains (`Arithmetic(split: test)`), 4 samples each, "
        f"every {scale.val_every} steps, sampled with the run's own settings; pass@1 is the unbiased estimator. "
        f"The warm start's held-out pass@1 at T = 1.0: **{base_pass:.3f}** (at other sampling temperatures "
        f"it is validated at that temperature, the baseline of those cells). A seed *collapsed* when its "
        f"final held-out pass@1 is more than {COLLAPSE} below its baseline, or its run failed. The runs' wall times add up to {seconds / 60:.1f} min (2 CPU cores; with "
        f"`--jobs 2` two run at a time, one thread each).",
        "",
    ]
    for name in names:
        exp = EXPERIMENTS[name]
        runs_by_cell, rows, notes, bases = {}, [], [], {}
        for cell in exp.cells[:scale.cells]:
            runs, failed = _runs(out, name, cell.label, scale.seeds)
            runs_by_cell[cell.label] = runs
            bases[cell.label] = cell_base = _final(_base(out, temperature(cell)), "val/pass@1")
            finals = [v for r in runs if (v := _final(r, "val/pass@1")) is not None]
            collapsed = [r for r in runs if (v := _final(r, "val/pass@1")) is not None and v < cell_base - COLLAPSE]
            reward = [v for r in runs if (v := _last_frac(r, "rollout/reward_mean")) is not None]
            ess = [statistics.mean(v for _, v in r["train/ess"]) for r in runs if r.get("train/ess")]
            delta = f"{statistics.mean(finals) - cell_base:+.3f} (from {cell_base:.3f})" if finals else "n/a"
            rows.append(f"| {cell.label} | {len(runs)}/{scale.seeds} | {_mean_std(finals)} | {delta} | "
                        f"{_mean_std(reward)} | {_mean_std(ess)} | {len(collapsed) + failed} |")
            notes += [f"- `{cell.label}` seed {r['seed']}: {_diagnosis(r)}" for r in collapsed]
            notes += [f"- `{cell.label}`: {failed} run(s) failed (see failed.txt in their folders)"] if failed else []
        png = img_dir / f"{name}.png"
        plot(out, exp, runs_by_cell, bases, png)
        lines += [f"## {exp.title}", "", exp.question, "",
                  f"`python -m experiments.run {name}`", "",
                  f"![{name}]({png.relative_to(results)})", "",
                  "| cell | seeds | final held-out pass@1 | vs warm start | training reward, last 10% | mean ESS | collapsed |",
                  "|---|---|---|---|---|---|---|", *rows, ""]
        if notes:
            lines += ["Collapsed or failed seeds, what their logs show:", "", *notes, ""]
    page = results / "results.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    return page
