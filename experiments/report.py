"""The results page and plots, made from the runs' summaries alone (experiments/results; never typed
by hand).

For each experiment: a PNG of training reward, held-out pass@1 and ESS against the optimizer step
(mean over seeds, the band spans min..max), and a table per cell: final held-out pass@1 at T = 1.0
(mean +- std over seeds), its change from the warm start, the training reward of the last 10% of
steps, the mean ESS, and the seeds that collapsed; cells sampled at another temperature add their
final held-out pass@1 at that temperature against the warm start's at it. A seed collapsed when its
final held-out pass@1 (T = 1.0) is more than COLLAPSE below the warm start's, or its run failed; for
each such seed the page lists what its logs show at the worst step (ESS, largest ratio, KL to pi_b,
response length), the place to start reading the mechanism.

Stress experiments (cells with a level) instead plot final held-out pass@1 against the level, a line
per method and a panel per learning rate (seeds' min..max shaded), and table each method's breaking
point: the lowest level at which at least 2 of 3 seeds (BREAK of the seeds) collapsed.
"""
from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

from .cells import EXPERIMENTS, Scale, base_folder, cell_lr, lr_tag, temperature

COLLAPSE = 0.10
BREAK = 2 / 3
ON_POLICY = {"k": 1, "S": 0}          # the stress axes' on-policy level: a break there is the learning rate's
CURVES = [("rollout/reward_mean", "training reward (sampled)"), ("val/pass@1", "held-out pass@1"),
          ("train/ess", "ESS e_B")]
# a stress experiment whose runs played multi-turn episodes (rollout/turns logged) also plots and tables
# these per run: the mean over its last 10% of steps, or (ESS) over every step
EPISODES = [("rollout/reward_mean", "training reward (1 / tries), last 10% of steps"),
            ("rollout/turns", "policy turns per episode, last 10% of steps"), ("train/ess", "mean ESS e_B")]


def read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """A summary's curves.csv (a row per step, a column per scalar, empty where not logged)."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for tag, value in row.items():
                if tag != "step" and value != "":
                    out.setdefault(tag, []).append((int(row["step"]), float(value)))
    return out


def read_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    return {k: sorted(v) for k, v in out.items()}


def _runs(summaries: Path, exp: str, cell, seeds: int) -> tuple[list[dict], int]:
    """The finished seeds' scalars (and `summary`: the summary.json), and the number of failed seeds."""
    runs, failed = [], 0
    folder = summaries / (cell.same_as or f"{exp}/{cell.label}")
    for s in range(seeds):
        d = folder / f"seed{s}"
        if (d / "summary.json").exists():
            summary = json.loads((d / "summary.json").read_text())
            runs.append({"seed": s, "summary": summary, **read_curves(d / "curves.csv")})
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
    """What the logs show at the worst step: the lowest ESS, or where ESS stays 1 (on-policy: off-policy
    data is not the cause) the largest gradient norm; and the run's extremes."""
    ess = run.get("train/ess", [])
    if not ess:
        return "no train/ess logged"
    step, low = min(ess, key=lambda p: p[1])
    if low >= 0.9995 and run.get("train/grad_norm"):
        step = max(run["train/grad_norm"], key=lambda p: p[1])[0]
        head = f"ESS >= {low:.4f} on every step; largest grad_norm at step {step}"
    else:
        head = f"lowest ESS {low:.3f} at step {step}"
    at = {tag: dict(run.get(tag, [])).get(step) for tag in ("train/ratio_max", "train/kl_behavior",
                                                            "rollout/response_len", "train/grad_norm")}
    kl_max = max((v for _, v in run.get("train/kl_behavior", [])), default=float("nan"))
    parts = [head]
    parts += [f"{t.split('/')[1]} {v:.3g}" for t, v in at.items() if v is not None]
    parts.append(f"max kl_behavior over the run {kl_max:.3g}")
    reward = [v for _, v in run.get("rollout/reward_mean", [])]
    if reward:
        parts.append(f"training reward {reward[0]:.2f} -> {reward[-1]:.2f}")
    return ", ".join(parts)


def _base(summaries: Path, temp: float, exp: str | None = None) -> float | None:
    """The warm start's held-out pass@1 sampled at `temp` (None: not measured yet): the one experiment
    `exp`'s runs started from (`<exp>/_base/`, written when it ran) where kept, else the page's."""
    for d in ([summaries / exp / "_base" / base_folder(temp)] if exp else []) + [summaries / "_base" / base_folder(temp)]:
        if (d / "curves.csv").exists():
            return _final(read_curves(d / "curves.csv"), "val/pass@1")
    return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(exp, runs_by_cell: dict[str, list[dict]], base: float, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES) + 2.5, 3.8))
    colors = {cell: plt.cm.tab20(i % 20) for i, cell in enumerate(runs_by_cell)}   # distinct up to 20 cells
    for ax, (tag, label) in zip(axes, CURVES):
        for cell, runs in runs_by_cell.items():
            series = [dict(r.get(tag, [])) for r in runs]
            if tag == "val/pass@1":                    # step 0: the warm start (held out at T = 1.0)
                series = [{0: base, **s} for s in series]
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


def plot_levels(exp, finals: dict[tuple[float, str], dict[int, list[float]]], base: float, path: Path,
                extra: dict[str, dict[tuple[float, str], dict[int, list[float]]]] | None = None) -> None:
    """Final held-out pass@1 against the level: a panel per learning rate, a line per method (mean over
    seeds, min..max shaded); the warm start dashed, the collapse line dotted. `extra` (y label -> the
    same layout of values) adds a panel per learning rate for each, e.g. turns per episode."""
    plt = _pyplot()
    lrs = sorted({lr for lr, _ in finals})
    methods = list(dict.fromkeys(m for _, m in finals))
    levels = sorted({lv for f in finals.values() for lv in f})
    x = {lv: i for i, lv in enumerate(levels)}                    # evenly spaced: levels grow geometrically
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    panels = [("final held-out pass@1 (T = 1.0)", lr, finals) for lr in lrs]
    panels += [(label, lr, values) for label, values in (extra or {}).items() for lr in lrs]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 2, 3.8), squeeze=False,
                             sharey=not extra)
    for ax, (ylabel, lr, values) in zip(axes[0], panels):
        for m in methods:
            pts = sorted((lv, v) for lv, v in values.get((lr, m), {}).items() if v)
            if not pts:
                continue
            xs = [x[lv] for lv, _ in pts]
            ax.plot(xs, [statistics.mean(v) for _, v in pts], label=m, color=colors[m], marker="o", ms=3)
            ax.fill_between(xs, [min(v) for _, v in pts], [max(v) for _, v in pts], color=colors[m], alpha=0.15)
        if values is finals:
            ax.axhline(base, color="gray", ls="--", lw=1, label="warm start")
            ax.axhline(base - COLLAPSE, color="gray", ls=":", lw=1, label="collapse line")
        ax.set_xticks(range(len(levels)), [str(lv) for lv in levels])
        ax.set_xlabel(exp.axis)
        ax.set_ylabel(ylabel)
        ax.set_title(f"lr {lr_tag(lr)[2:]}")
        ax.grid(alpha=0.3)
    legend = {}                                                   # every panel's lines, once
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="center right")
    fig.suptitle(exp.title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1 - 2 / (5.5 * len(panels) + 2), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _collapsed(runs: list[dict], base: float) -> list[dict]:
    return [r for r in runs if (v := _final(r, "val/pass@1")) is not None and v < base - COLLAPSE]


def _section(name: str, exp, summaries: Path, results: Path, scale: Scale, base: float) -> list[str]:
    """An experiment's plot against the step and its table per cell."""
    runs_by_cell, rows, notes = {}, [], []
    own = any(temperature(c) != 1.0 for c in exp.cells[:scale.cells])
    for cell in exp.cells[:scale.cells]:
        runs, failed = _runs(summaries, name, cell, scale.seeds)
        runs_by_cell[cell.label] = runs
        finals = [v for r in runs if (v := _final(r, "val/pass@1")) is not None]
        collapsed = _collapsed(runs, base)
        reward = [v for r in runs if (v := _last_frac(r, "rollout/reward_mean")) is not None]
        ess = [statistics.mean(v for _, v in r["train/ess"]) for r in runs if r.get("train/ess")]
        delta = f"{statistics.mean(finals) - base:+.3f}" if finals else "n/a"
        row = f"| {cell.label} | {len(runs)}/{scale.seeds} | {_mean_std(finals)} | {delta} | "
        if own:
            temp, own_base = temperature(cell), _base(summaries, temperature(cell), name)
            at_t = [r["summary"]["own_temperature"]["val/pass@1"] if temp != 1.0 else _final(r, "val/pass@1")
                    for r in runs]
            at_t = [v for v in at_t if v is not None]
            vs = "n/a" if not at_t or own_base is None else \
                f"{statistics.mean(at_t) - own_base:+.3f} (from {own_base:.3f})"
            row += f"{_mean_std(at_t)} | {vs} | "
        rows.append(row + f"{_mean_std(reward)} | {_mean_std(ess)} | {len(collapsed) + failed} |")
        notes += [f"- `{cell.label}` seed {r['seed']}: {_diagnosis(r)}" for r in collapsed]
        notes += [f"- `{cell.label}`: {failed} run(s) failed (see failed.txt in their folders)"] if failed else []
    png = results / "img" / "experiments" / f"{name}.png"
    plot(exp, runs_by_cell, base, png)
    head = "| cell | seeds | final held-out pass@1 (T = 1.0) | vs warm start | "
    head += "final held-out pass@1 at the cell's T | vs warm start at T | " if own else ""
    head += "training reward, last 10% | mean ESS | collapsed |"
    lines = [f"![{name}]({png.relative_to(results)})", "", head, "|---" * head.count(" | ") + "|---|", *rows, ""]
    if notes:
        lines += ["Collapsed or failed seeds, what their logs show:", "", *notes, ""]
    return lines


def _stress_section(name: str, exp, summaries: Path, results: Path, scale: Scale, base: float) -> list[str]:
    """A stress experiment: pass@1 against the level, the breaking-point table, a table per learning rate."""
    finals: dict[tuple[float, str], dict[int, list[float]]] = {}
    counts: dict[tuple[float, str], dict[int, tuple[int, int, int]]] = {}   # level -> (finished, collapsed, failed)
    diagnosed: dict[tuple[float, str, int], list[str]] = {}
    lags: dict[int, list[float]] = {}                                        # level -> each run's mean lag
    episodes: dict[str, dict[tuple[float, str], dict[int, list[float]]]] = {label: {} for _, label in EPISODES}
    for cell in exp.cells[:scale.cells]:
        runs, failed = _runs(summaries, name, cell, scale.seeds)
        line = (cell_lr(cell), cell.method)
        for tag, label in EPISODES:
            per_run = [(statistics.mean(v for _, v in r[tag]) if tag == "train/ess" else _last_frac(r, tag))
                       for r in runs if r.get(tag)]
            episodes[label].setdefault(line, {})[cell.level] = per_run
        finals.setdefault(line, {})[cell.level] = [v for r in runs if (v := _final(r, "val/pass@1")) is not None]
        lags.setdefault(cell.level, []).extend(statistics.mean(v for _, v in r["train/policy_lag"])
                                               for r in runs if r.get("train/policy_lag"))
        collapsed = _collapsed(runs, base)
        counts.setdefault(line, {})[cell.level] = (len(runs), len(collapsed), failed)
        diagnosed[(*line, cell.level)] = [f"- `{cell.label}` seed {r['seed']}: {_diagnosis(r)}" for r in collapsed]
    multi_turn = any(v for f in episodes[EPISODES[1][1]].values() for v in f.values())
    if not multi_turn:
        episodes = {}
    png = results / "img" / "experiments" / f"{name}.png"
    plot_levels(exp, finals, base, png, {label: episodes[label] for _, label in EPISODES[:2]} if episodes else None)
    lrs = sorted({lr for lr, _ in finals})
    methods = list(dict.fromkeys(m for _, m in finals))
    levels = sorted({lv for f in finals.values() for lv in f})
    letter = exp.axis.split()[-1]

    def breaking(lr: float, m: str) -> tuple[str, int | None]:
        """The first level where BREAK of the seeds collapsed; a lower level with seeds missing (not run
        or not summarized) could have broken first, so the answer stops there."""
        by_level = counts.get((lr, m), {})
        if not any(sum(by_level.get(lv, (0, 0, 0))[::2]) for lv in levels):
            return "not run", None
        for i, lv in enumerate(levels):
            done, coll, failed = by_level.get(lv, (0, 0, 0))
            if coll + failed >= BREAK * scale.seeds:
                where = f"{letter} = {lv} ({coll + failed}/{done + failed})"
                return (where + ", on-policy: the learning rate breaks" if lv == ON_POLICY[letter] else where), lv
            if done + failed < scale.seeds:
                below = f"none up to {letter} = {levels[i - 1]}, " if i else ""
                return f"{below}{letter} = {lv} incomplete ({done + failed}/{scale.seeds} seeds)", None
        return f"none up to {letter} = {levels[-1]}", None

    lines = [f"![{name}]({png.relative_to(results)})", "",
             f"Breaking point: the lowest {exp.axis} at which at least {BREAK * scale.seeds:.0f} of {scale.seeds} "
             f"seeds collapsed (final held-out pass@1 at T = 1.0 below {base - COLLAPSE:.3f}, the warm start's "
             f"{base:.3f} minus {COLLAPSE}, or the run failed).", "",
             "| method | " + " | ".join(f"lr {lr_tag(lr)[2:]}" for lr in lrs) + " |", "|---" * (len(lrs) + 1) + "|"]
    lag_text = ", ".join(f"{letter} = {lv}: {statistics.mean(lags[lv]):.1f}" for lv in levels if lags.get(lv))
    notes = []
    for m in methods:
        cells = [breaking(lr, m) for lr in lrs]
        lines.append(f"| {m} | " + " | ".join(text for text, _ in cells) + " |")
        notes += [n for lr, (_, lv) in zip(lrs, cells) if lv is not None for n in diagnosed.get((lr, m, lv), [])]
    lines.append("")
    if lag_text:
        lines += [f"The policy lag the runs trained at (optimizer steps, mean over steps and runs): {lag_text}.", ""]
    for lr in lrs:
        lines += [f"Final held-out pass@1 (T = 1.0), lr {lr_tag(lr)[2:]}: mean +- std over seeds "
                  "(collapsed seeds).", "",
                  "| method | " + " | ".join(f"{letter} = {lv}" for lv in levels) + " |",
                  "|---" * (len(levels) + 1) + "|"]
        for m in methods:
            row = []
            for lv in levels:
                done, coll, failed = counts.get((lr, m), {}).get(lv, (0, 0, 0))
                vals = finals.get((lr, m), {}).get(lv, [])
                row.append(f"{_mean_std(vals)} ({coll + failed})" if done + failed else "")
            lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines.append("")
        for label, values in episodes.items():       # multi-turn: the episodes' reward, turns and the ESS
            lines += [f"{label[0].upper() + label[1:]}, lr {lr_tag(lr)[2:]}: mean +- std over seeds.", "",
                      "| method | " + " | ".join(f"{letter} = {lv}" for lv in levels) + " |",
                      "|---" * (len(levels) + 1) + "|"]
            lines += [f"| {m} | " + " | ".join(_mean_std(values.get((lr, m), {}).get(lv, [])) for lv in levels) + " |"
                      for m in methods]
            lines.append("")
    if notes:
        lines += ["At each breaking point, the collapsed seeds' logs:", "", *notes, ""]
    return lines


def write_report(summaries: Path, results: Path, scale: Scale, command: str) -> Path:
    """Write `results/results.md` and `results/img/experiments/<exp>.png` from every experiment's
    summaries under `summaries`; return the page's path."""
    base = _base(summaries, 1.0)
    if base is None:
        raise SystemExit(f"{summaries}/_base/val holds no summary of the warm start: run an experiment first")
    seconds = sum(json.loads(p.read_text())["seconds"] for p in summaries.rglob("summary.json")
                  if "seconds" in p.read_text())
    lines = [
        "# Results: the paper's experiments at CPU scale",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from the runs' "
        f"summaries in `{summaries.relative_to(summaries.parents[1]) if len(summaries.parents) > 1 else summaries}`; "
        f"never edited by hand.",
        "",
        f"Every run: the same warm-started tiny model (1.8M-parameter Qwen2, supervised for {scale.sft_steps} "
        f"steps on 2-digit addition with 30% wrong labels), {scale.prompts} prompts x {scale.samples} samples per "
        f"rollout, 8 new tokens, lr 2e-4 unless a cell says otherwise, {scale.steps} optimizer steps, "
        f"{scale.seeds} seed(s) per cell. Held out: {scale.val_prompts} sums that no training prompt contains "
        f"(`Arithmetic(split: test)`), 4 samples each, every {scale.val_every} steps, sampled at T = 1.0 in "
        f"every run (`val_sampling`: one ruler, whatever the run samples with); pass@1 is the unbiased "
        f"estimator. The warm start's held-out pass@1 at T = 1.0: **{base:.3f}**. Cells sampled at another "
        f"temperature are also evaluated once more after training at their own temperature, against the "
        f"warm start at it. A seed *collapsed* when its final held-out pass@1 (T = 1.0) is more than "
        f"{COLLAPSE} below the warm start's, or its run failed. The stored runs' wall times add up to "
        f"{seconds / 60:.1f} min (2 CPU cores; with `--jobs 2` two run at a time, one thread each).",
        "",
    ]
    for name, exp in EXPERIMENTS.items():
        lines += [f"## {exp.title}", "", exp.question, "", f"`python -m experiments.run {name}`", ""]
        if exp.size:
            own = exp.sized(scale)
            lines += [f"This experiment's runs are smaller than the rest: {own.prompts} prompts x {own.samples} "
                      f"samples per rollout, {own.steps} optimizer steps, held out every {own.val_every} steps.", ""]
        if not any(_runs(summaries, name, c, scale.seeds) != ([], 0) for c in exp.cells[:scale.cells]):
            lines += ["Not run yet (no summaries).", ""]
            continue
        own_base = _base(summaries, 1.0, name)
        if own_base != base:
            lines += [f"This experiment's runs started from another warm start (the same config, made again): its "
                      f"held-out pass@1 at T = 1.0 is **{own_base:.3f}**, the collapse line {own_base - COLLAPSE:.3f}.", ""]
        section = _stress_section if exp.axis else _section
        lines += section(name, exp, summaries, results, scale, own_base)
    page = results / "results.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    return page
