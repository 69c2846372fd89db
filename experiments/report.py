"""The results page and plots, made from the runs' summaries alone (experiments/results; never typed
by hand).

For each experiment: a PNG of training reward, held-out pass@1 and ESS against the optimizer step
(mean over seeds, the band spans min..max), and a table per cell: final held-out pass@1 at T = 1.0
(mean over seeds and its 95% bootstrap interval), its change from the warm start, the training reward
of the last 10% of steps, the mean ESS, and the seeds that collapsed (with a 95% Wilson interval);
cells sampled at another temperature add their final held-out pass@1 at that temperature against the
warm start's at it. A seed collapsed when its final held-out pass@1 (T = 1.0) is more than COLLAPSE
below the warm start's, or its run failed; for each such seed the page lists what its logs show at the
worst step (ESS, largest ratio, KL to pi_b, response length), the place to start reading the mechanism.
Every experiment then says which of its tested differences (`pairs`) are resolved, the two intervals
apart, and which are not; the page ends with what that supports about the paper's claims (`claims`).

Stress experiments (cells with a level) instead plot final held-out pass@1 against the level, a line
per method and a panel per learning rate (seeds' min..max shaded), and table each method's breaking
point: the lowest level at which at least BREAK of the seeds (2 of 3, 6 of 8) collapsed.

A cell has the seeds stored for it (at least `Scale.seeds` where it is complete); cells run from other
warm starts (`warm<w>/` beside the summaries) get their own section.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from .cells import (EXPERIMENTS, REMEDIES_K, REMEDY_EXPERIMENTS, Scale, base_folder, cell_lr, lr_tag,
                    temperature)
from .intervals import RESAMPLES, apart, bootstrap_mean, wilson

COLLAPSE = 0.10
BREAK = 2 / 3
ON_POLICY = {"k": 1, "S": 0}          # the stress axes' on-policy level: a break there is the learning rate's
CURVES = [("rollout/reward_mean", "training reward (sampled)"), ("val/pass@1", "held-out pass@1"),
          ("train/ess", "ESS e_B")]


# a stress experiment whose runs played multi-turn episodes (rollout/turns logged) also plots and tables
# these per run: the mean over its last 10% of steps, or (ESS) over every step
EPISODES = [("rollout/reward_mean", "training reward (1 / tries), last 10% of steps"),
            ("rollout/turns", "policy turns per episode, last 10% of steps"), ("train/ess", "mean ESS e_B")]


# How a run's samples were seeded: its summary's `seed_scheme` (lit_ess.sampling.SEED_SCHEME when it ran);
# summaries written before the field (before 2026-11-27) were all drawn per sample. Both draw from the same
# distribution; a run drawn under one scheme is not repeated under the other.
LEGACY_SEED_SCHEME = "per-sample"
SEED_SCHEMES = {"per-sample": "one vLLM request per sample, seeded by (seed, step, prompt, sample)",
                "per-group": "one vLLM request per prompt's group, sample j seeded with the group's seed + j"}


def seed_scheme(run: dict) -> str:
    """The seed scheme of a stored run (an entry of `_runs`)."""
    return run["summary"].get("seed_scheme", LEGACY_SEED_SCHEME)


def cell_seed_scheme(runs: list[dict]) -> str | None:
    """Which seed scheme a cell's stored runs used: its name, `mixed (2 per-group, 1 per-sample of 3)`, or
    None for a cell without runs."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[seed_scheme(r)] = counts.get(seed_scheme(r), 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), None)
    return f"mixed ({', '.join(f'{k} {name}' for name, k in sorted(counts.items()))} of {len(runs)})"


def seed_schemes(name: str, exp, summaries: Path, scale: Scale) -> str:
    """One sentence: the seed scheme of the experiment's stored runs, per cell where they differ."""
    by: dict[str, list[str]] = {}
    for cell in exp.cells[:scale.cells]:
        if (scheme := cell_seed_scheme(_runs(summaries, name, cell)[0])) is not None:
            by.setdefault(scheme, []).append(cell.label)
    if len(by) == 1:
        scheme = next(iter(by))
        return f"Sampling seeds: every stored run **{scheme}** ({SEED_SCHEMES.get(scheme, scheme)})."
    cells = "; ".join(f"**{scheme}**: {', '.join(f'`{c}`' for c in labels)}" for scheme, labels in by.items())
    return (f"Sampling seeds, by cell ({'; '.join(f'{k}: {v}' for k, v in SEED_SCHEMES.items())}): {cells}."
            if by else "")


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


def _runs(summaries: Path, exp: str, cell) -> tuple[list[dict], int]:
    """Every stored seed's scalars (and `summary`: the summary.json), and the number of failed seeds.
    A cell has as many seeds as were run for it (`--seeds`): the page reads them all."""
    runs, failed = [], 0
    folder = summaries / (cell.same_as or f"{exp}/{cell.label}")
    seeds = sorted(int(d.name[4:]) for d in folder.glob("seed*") if d.name[4:].isdigit()) if folder.is_dir() else []
    for s in seeds:
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


def _mean_ci(xs: list[float]) -> str:
    """`mean [lo, hi]`: the bootstrap 95% interval of the mean over seeds."""
    if not xs:
        return "n/a"
    lo, hi = bootstrap_mean(xs)
    return f"{statistics.mean(xs):.3f} [{lo:.3f}, {hi:.3f}]" if len(xs) > 1 else f"{xs[0]:.3f}"


def _count_ci(k: int, n: int) -> str:
    """`k/n [lo, hi]`: a collapse count and its Wilson 95% interval."""
    return f"{k}/{n} [{wilson(k, n)[0]:.2f}, {wilson(k, n)[1]:.2f}]" if n else "0/0"


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
    """The curves (and a trace experiment's traces) against the step: each cell's mean over seeds, its
    seeds' min..max shaded; up to 4 panels a row."""
    plt = _pyplot()
    curves = [*CURVES, *exp.traces]
    cols = min(len(curves), 4)
    rows = math.ceil(len(curves) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols + 2.5, 3.8 * rows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(curves):]:
        ax.set_visible(False)
    colors = {cell: plt.cm.tab20(i % 20) for i, cell in enumerate(runs_by_cell)}   # distinct up to 20 cells
    for ax, (tag, label) in zip(axes, curves):
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
    fig.tight_layout(rect=(0, 0, 1 - 2.5 / (5 * cols + 2.5), 1))
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


@dataclass
class CellStats:
    """A cell's outcome over its seeds, what its intervals are made of."""
    finals: list[float]       # each finished seed's final held-out pass@1 (T = 1.0)
    collapsed: int            # seeds below the collapse line, failed runs included
    n: int                    # seeds finished or failed
    scheme: str | None = None  # the seed scheme its finished runs used (cell_seed_scheme)

    def mean_ci(self) -> tuple[float, float] | None:
        return bootstrap_mean(self.finals) if len(self.finals) > 1 else None

    def rate_ci(self) -> tuple[float, float] | None:
        return wilson(self.collapsed, self.n) if self.n else None

    def text(self) -> str:
        return f"{_mean_ci(self.finals)}; {_count_ci(self.collapsed, self.n)}" if self.n else ""


def cell_stats(summaries: Path, base: float, scale: Scale) -> dict[tuple[str, str], CellStats]:
    """(experiment, cell) -> its stats, for every cell with a summary or a failed run under `summaries`."""
    out = {}
    for name, exp in EXPERIMENTS.items():
        for cell in exp.cells[:scale.cells]:
            # the warm start the runs started from: the experiment's that ran them (a `same_as` cell's is its own)
            ran = cell.same_as.split("/")[0] if cell.same_as else name
            own = _base(summaries, 1.0, ran) or base
            runs, failed = _runs(summaries, name, cell)
            if runs or failed:
                out[(name, cell.label)] = CellStats([v for r in runs if (v := _final(r, "val/pass@1")) is not None],
                                                    len(_collapsed(runs, own)) + failed, len(runs) + failed,
                                                    cell_seed_scheme(runs))
    return out


_T = (0.6, 1.2, 1.5)
# The differences each experiment's question is about (P3O's cell first where P3O is in the pair); an
# experiment not named here tests every pair of its cells, a stress experiment P3O against every other
# method at the same learning rate and level.
PAIRS = {
    **{name: [(c.label, ref) for c in EXPERIMENTS[name].cells if c.method in REMEDIES_K
              for ref in (c.label.replace(c.method, "p3o", 1), c.label.replace(c.method, "grpo_eps0.2", 1))]
       for name in REMEDY_EXPERIMENTS},
    "clip": [("p3o", b) for b in ("grpo_eps0.2", "grpo_eps0.4", "grpo_eps0.6", "dapo")],
    "ablations": [("p3o", b) for b in ("p3o_no_kl", "p3o_no_cap", "p3o_ess_micro")],
    "precision": [("p3o_bfloat16", "grpo_bfloat16"), ("p3o_float32", "grpo_float32"),
                  ("grpo_bfloat16", "grpo_float32"), ("p3o_bfloat16", "p3o_float32")],
    "staleness": [(f"p3o_S{s}", f"{m}_S{s}") for s in (0, 1, 2, 4) for m in ("grpo", "decoupled")],
    "inflight": [("p3o_in_flight", "grpo_eps0.2_in_flight"), ("p3o_drain", "grpo_eps0.2_drain"),
                 ("p3o_in_flight", "p3o_drain"), ("grpo_eps0.2_in_flight", "grpo_eps0.2_drain")],
    "temperature": [(f"p3o_T{t}_{lp}", f"grpo_T{t}_{lp}") for t in _T for lp in ("processed", "raw")]
                   + [(f"{m}_T{t}_processed", f"{m}_T{t}_raw") for t in _T for m in ("p3o", "grpo")]
                   + [("p3o_T1.5_processed_no_kl", "p3o_T1.5_processed")]
                   + [(f"p3o_T{t}_processed_k4_anchor", f"p3o_T{t}_processed_k4") for t in _T],
}


# the remedy at T = 1.5 against P3O with the trainer-temperature anchor too (the KL remedy of the temperature section)
PAIRS["remedies_temperature"] += [("p3o_k3_sampled_capped_T1.5_processed_k4", "p3o_T1.5_processed_k4_anchor")]


def pairs(name: str, exp) -> list[tuple[str, str]]:
    """The pairs of cells whose difference the page tests (none in a trace experiment)."""
    if exp.traces:
        return []
    labels = [c.label for c in exp.cells]
    if exp.axis:                 # a cell run in another experiment (`same_as`) is tested there
        by = {(cell_lr(c), c.level, c.method): c.label for c in exp.cells if c.same_as is None}
        return [(by[(lr, lv, "p3o")], label) for (lr, lv, m), label in by.items()
                if m != "p3o" and (lr, lv, "p3o") in by]
    if name in PAIRS:
        return [(a, b) for a, b in PAIRS[name] if a in labels and b in labels]
    return list(itertools.combinations(labels, 2))


def _seed_counts(stats: list[CellStats]) -> str:
    ns = sorted({s.n for s in stats})
    return "no" if not ns else str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


def differences(name: str, exp, stats: dict[tuple[str, str], CellStats]) -> str:
    """One sentence: which of the experiment's tested differences are resolved (95% intervals apart), for
    the means and for the collapse counts, and which are not, at the seed counts stored."""
    means, counts, unresolved, seen = [], [], [], []
    for a, b in pairs(name, exp):
        sa, sb = stats.get((name, a)), stats.get((name, b))
        if sa is None or sb is None or sa.mean_ci() is None or sb.mean_ci() is None:
            continue
        seen += [sa, sb]
        d = apart(sa.mean_ci(), sb.mean_ci())
        if d:
            means.append(f"`{a}` {'above' if d > 0 else 'below'} `{b}` ({statistics.mean(sa.finals):.3f} vs "
                         f"{statistics.mean(sb.finals):.3f})")
        else:
            unresolved.append(f"`{a}` vs `{b}`")
        if (c := apart(sa.rate_ci(), sb.rate_ci())):
            counts.append(f"`{a}` {'more' if c > 0 else 'fewer'} than `{b}` ({sa.collapsed}/{sa.n} vs {sb.collapsed}/{sb.n})")
    if not seen:
        return ""
    text = (f"**Resolved at {_seed_counts(seen)} seeds per cell** (95% intervals apart), means: "
            f"{'; '.join(means) or 'none'}; collapse counts: {'; '.join(counts) or 'none'}. ")
    return text + f"**Not resolved** (the means' intervals overlap): {', '.join(unresolved) or 'none'}."


def _section(name: str, exp, summaries: Path, results: Path, scale: Scale, base: float,
             stats: dict[tuple[str, str], CellStats]) -> list[str]:
    """An experiment's plot against the step, its table per cell, and which differences are resolved."""
    runs_by_cell, rows, notes = {}, [], []
    own = any(temperature(c) != 1.0 for c in exp.cells[:scale.cells])
    # in-flight updates: how many rows mixed versions and how old their tokens were (when the runs logged it)
    mixing = any(r.get("rollout/multi_version_frac") for c in exp.cells[:scale.cells] for r in _runs(summaries, name, c)[0])
    for cell in exp.cells[:scale.cells]:
        runs, failed = _runs(summaries, name, cell)
        runs_by_cell[cell.label] = runs
        finals = [v for r in runs if (v := _final(r, "val/pass@1")) is not None]
        collapsed = _collapsed(runs, base)
        reward = [v for r in runs if (v := _last_frac(r, "rollout/reward_mean")) is not None]
        ess = [statistics.mean(v for _, v in r["train/ess"]) for r in runs if r.get("train/ess")]
        delta = f"{statistics.mean(finals) - base:+.3f}" if finals else "n/a"
        row = f"| {cell.label} | {len(runs)}/{max(scale.seeds, len(runs) + failed)} | {_mean_ci(finals)} | {delta} | "
        if own:
            temp, own_base = temperature(cell), _base(summaries, temperature(cell), name)
            at_t = [r["summary"]["own_temperature"]["val/pass@1"] if temp != 1.0 else _final(r, "val/pass@1")
                    for r in runs]
            at_t = [v for v in at_t if v is not None]
            vs = "n/a" if not at_t or own_base is None else \
                f"{statistics.mean(at_t) - own_base:+.3f} (from {own_base:.3f})"
            row += f"{_mean_ci(at_t)} | {vs} | "
        if mixing:
            mixed = [statistics.mean(v for _, v in r["rollout/multi_version_frac"]) for r in runs
                     if r.get("rollout/multi_version_frac")]
            lag = [statistics.mean(v for _, v in r["train/token_lag"]) for r in runs if r.get("train/token_lag")]
            row += f"{_mean_std(mixed)} | {_mean_std(lag)} | "
        rows.append(row + f"{_mean_std(reward)} | {_mean_std(ess)} | {_count_ci(len(collapsed) + failed, len(runs) + failed)} |")
        notes += [f"- `{cell.label}` seed {r['seed']}: {_diagnosis(r)}" for r in collapsed]
        notes += [f"- `{cell.label}`: {failed} run(s) failed (see failed.txt in their folders)"] if failed else []
    png = results / "img" / "experiments" / f"{name}.png"
    plot(exp, runs_by_cell, base, png)
    head = "| cell | seeds | final held-out pass@1 (T = 1.0) [95% CI] | vs warm start | "
    head += "final held-out pass@1 at the cell's T [95% CI] | vs warm start at T | " if own else ""
    head += "rows of 2+ versions (+- std) | mean token lag (+- std) | " if mixing else ""
    head += "training reward, last 10% (+- std) | mean ESS (+- std) | collapsed [95% CI] |"
    lines = [f"![{name}]({png.relative_to(results)})", "", head, "|---" * head.count(" | ") + "|---|", *rows, ""]
    if exp.traces:
        lines += trace_table(exp, runs_by_cell) + trace_reading(exp, runs_by_cell)
    if (sentence := differences(name, exp, stats)):
        lines += [sentence, ""]
    if notes:
        lines += ["Collapsed or failed seeds, what their logs show:", "", *notes, ""]
    return lines


def trace_means(runs: list[dict], tag: str) -> tuple[float | None, float | None]:
    """A trace's mean over the seeds of its mean over the first steps off-policy (steps 2-6: the lag grows
    to its bound) and over the last quarter of the steps; None where no run logged it there."""
    last = max((t for r in runs for t, _ in r.get("train/ess", [])), default=0)
    out = []
    for lo, hi in ((2, 6), (last - last // 4 + 1, last)):
        per_run = [statistics.mean(v for t, v in r[tag] if lo <= t <= hi) for r in runs
                   if any(lo <= t <= hi for t, _ in r.get(tag, []))]
        out.append(statistics.mean(per_run) if per_run else None)
    return out[0], out[1]


def trace_table(exp, runs_by_cell: dict[str, list[dict]]) -> list[str]:
    """A trace experiment's numbers behind its figure (`trace_means` of each trace)."""
    head = "| cell | " + " | ".join(label for _, label in exp.traces) + " |"
    rows = []
    for cell, runs in runs_by_cell.items():
        parts = [" / ".join("n/a" if v is None else f"{v:.3g}" for v in trace_means(runs, tag)) for tag, _ in exp.traces]
        rows.append(f"| {cell} ({len(runs)} seeds) | " + " | ".join(parts) + " |")
    return ["Each trace: mean over seeds of its mean over steps 2-6 / over the last quarter of the steps.", "",
            head, "|---" * (len(exp.traces) + 1) + "|", *rows, ""]


def trace_reading(exp, runs_by_cell: dict[str, list[dict]]) -> list[str]:
    """What the traces say, P3O against GRPO (eps 0.2) at each staleness S, in sentences whose every number is
    read from the table above (so a reader can check them), then what they point at."""
    def pct(v): return "n/a" if v is None else f"{v:.0%}"
    def num(v): return "n/a" if v is None else f"{v:.3g}"
    def times(a, b): return "n/a" if a is None or not b else f"{a / b:.1f}x"
    said = []
    for lv in sorted({c.level for c in exp.cells}):
        p3o = next((runs_by_cell.get(c.label) for c in exp.cells if c.level == lv and c.method == "p3o"), None)
        grpo = next((runs_by_cell.get(c.label) for c in exp.cells if c.level == lv and c.method == "grpo_eps0.2"), None)
        if not p3o or not grpo:
            continue
        (gp0, gp1), (gg0, gg1) = trace_means(p3o, "train/grad_norm"), trace_means(grpo, "train/grad_norm")
        lo_p, lo_g = trace_means(p3o, "train/grad_share_rho_lo"), trace_means(grpo, "train/grad_share_rho_lo")
        kl, capped = trace_means(p3o, "train/kl_grad_share"), trace_means(p3o, "train/capped_frac")
        said.append(
            f"- S = {lv} ({len(p3o)} and {len(grpo)} seeds): P3O's gradient norm is {times(gp0, gg0)} "
            f"GRPO's in steps 2-6 ({num(gp0)} vs {num(gg0)}) and {times(gp1, gg1)} in the last quarter "
            f"({num(gp1)} vs {num(gg1)}); the share of its |dL/dlp| on tokens with rho < 1/2 goes from "
            f"{pct(lo_p[0])} to {pct(lo_p[1])} (GRPO: {pct(lo_g[0])} to {pct(lo_g[1])}), the (1 - e_B) KL term's "
            f"share from {pct(kl[0])} to {pct(kl[1])}; {pct(capped[1])} of P3O's tokens are capped at e_B late.")
    if not said:
        return []
    return ["**Reading the traces.** " + "What the table says, P3O against GRPO (eps 0.2):", "", *said, "",
            "What these numbers point at: k3's gradient in the log-ratio, (1 - e_B)(1 - 1/rho), grows without bound "
            "as rho -> 0, so the staler the rows, the harder the KL term pulls the policy back toward tokens it has "
            "left (k3 is an estimate of KL(pi ‖ pi_b) for tokens drawn from pi, and the rows were drawn from pi_b); and the cap weighs every token "
            "with rho > e_B by e_B whatever its ratio, where GRPO's clip stops pushing a token once rho leaves "
            "[0.8, 1.2] in its advantage's direction. The first is tested by the remedy sections below (the KL term "
            "estimated on the sampler's tokens, `kl_estimator: k3_sampled`, whose gradient rho log rho vanishes as "
            "rho -> 0), the second by stress_s's `p3o_no_kl` cells (P3O without the KL term at all).", ""]


def breaking(by_level: dict[int, CellStats], levels: list[int], letter: str, seeds: int) -> tuple[str, int | None]:
    """A stress line's breaking point: the first level where at least BREAK of its seeds (at least `seeds`
    of them) collapsed; a lower level with fewer than `seeds` seeds (not run or not summarized) could have
    broken first, so the answer stops there."""
    if not any(s.n for s in by_level.values()):
        return "not run", None
    for i, lv in enumerate(levels):
        s = by_level.get(lv, CellStats([], 0, 0))
        if s.collapsed >= BREAK * max(seeds, s.n):
            where = f"{letter} = {lv} ({_count_ci(s.collapsed, s.n)})"
            return (where + ", on-policy: the learning rate breaks" if lv == ON_POLICY[letter] else where), lv
        if s.n < seeds:
            below = f"none up to {letter} = {levels[i - 1]}, " if i else ""
            return f"{below}{letter} = {lv} incomplete ({s.n}/{seeds} seeds)", None
    top = by_level.get(levels[-1], CellStats([], 0, 0))
    return f"none up to {letter} = {levels[-1]} ({_count_ci(top.collapsed, top.n)} there)", None


def _lines(name: str, exp, stats: dict[tuple[str, str], CellStats], scale: Scale):
    """A stress experiment's cells as lines: (lr, method) -> level -> stats, and the sorted levels."""
    by_line: dict[tuple[float, str], dict[int, CellStats]] = {}
    for cell in exp.cells[:scale.cells]:
        if (s := stats.get((name, cell.label))) is not None:
            by_line.setdefault((cell_lr(cell), cell.method), {})[cell.level] = s
    return by_line, sorted({c.level for c in exp.cells[:scale.cells]})


def _stored_stats(summaries: Path, scale: Scale) -> dict[tuple[str, str], CellStats]:
    """Every cell's stats from the stored summaries, against warm start 0's line: what selections read."""
    base = _base(summaries, 1.0)
    if base is None:
        raise SystemExit(f"{summaries}/_base/val holds no summary of the warm start: nothing to select from")
    return cell_stats(summaries, base, scale)


def decisive(summaries: Path, scale: Scale) -> list[tuple[str, str]]:
    """The stress cells that decide a breaking point, from the stored summaries: on each experiment and
    learning rate, every method at each level where some method breaks and at the level below it, and
    each method that breaks nowhere at the top level."""
    stats, chosen = _stored_stats(summaries, scale), []
    for name, exp in EXPERIMENTS.items():
        if not exp.axis:
            continue
        by_line, levels = _lines(name, exp, stats, scale)
        letter = exp.axis.split()[-1]
        for lr in sorted({cell_lr(c) for c in exp.cells[:scale.cells]}):
            broke = {m: breaking(by_line.get((lr, m), {}), levels, letter, scale.seeds)[1]
                     for m in dict.fromkeys(c.method for c in exp.cells)}
            keep = {lv for b in broke.values() if b is not None
                    for lv in levels[max(0, levels.index(b) - 1):levels.index(b) + 1]}
            chosen += [(name, c.label) for c in exp.cells[:scale.cells] if cell_lr(c) == lr and
                       (c.level in keep or (c.level == levels[-1] and broke[c.method] is None))]
    return chosen


def resolved(summaries: Path, scale: Scale) -> list[tuple[str, str]]:
    """Both cells of every pair a section tests (`pairs`) whose means' or collapse counts' intervals are
    apart, from the stored summaries: at 3 seeds an interval is the seeds' min..max, so these are the calls
    to back with more."""
    stats, chosen = _stored_stats(summaries, scale), []
    for name, exp in EXPERIMENTS.items():
        for a, b in pairs(name, exp):
            sa, sb = stats.get((name, a)), stats.get((name, b))
            if sa is None or sb is None or sa.mean_ci() is None or sb.mean_ci() is None:
                continue
            if apart(sa.mean_ci(), sb.mean_ci()) or apart(sa.rate_ci(), sb.rate_ci()):
                chosen += [(name, a), (name, b)]
    return list(dict.fromkeys(chosen))


def _stress_section(name: str, exp, summaries: Path, results: Path, scale: Scale, base: float,
                    stats: dict[tuple[str, str], CellStats]) -> list[str]:
    """A stress experiment: pass@1 against the level, the breaking-point table, a table per learning rate,
    and which breaks and differences are resolved."""
    finals: dict[tuple[float, str], dict[int, list[float]]] = {}
    diagnosed: dict[tuple[float, str, int], list[str]] = {}
    lags: dict[int, list[float]] = {}                                        # level -> each run's mean lag
    episodes: dict[str, dict[tuple[float, str], dict[int, list[float]]]] = {label: {} for _, label in EPISODES}
    for cell in exp.cells[:scale.cells]:
        runs, _ = _runs(summaries, name, cell)
        line = (cell_lr(cell), cell.method)
        for tag, label in EPISODES:
            per_run = [(statistics.mean(v for _, v in r[tag]) if tag == "train/ess" else _last_frac(r, tag))
                       for r in runs if r.get(tag)]
            episodes[label].setdefault(line, {})[cell.level] = per_run
        finals.setdefault(line, {})[cell.level] = [v for r in runs if (v := _final(r, "val/pass@1")) is not None]
        lags.setdefault(cell.level, []).extend(statistics.mean(v for _, v in r["train/policy_lag"])
                                               for r in runs if r.get("train/policy_lag"))
        diagnosed[(*line, cell.level)] = [f"- `{cell.label}` seed {r['seed']}: {_diagnosis(r)}"
                                          for r in _collapsed(runs, base)]
    by_line, levels = _lines(name, exp, stats, scale)
    if not any(v for f in episodes[EPISODES[1][1]].values() for v in f.values()):
        episodes = {}                             # single-turn runs: no episode tables or panels
    png = results / "img" / "experiments" / f"{name}.png"
    plot_levels(exp, finals, base, png, {label: episodes[label] for _, label in EPISODES[:2]} if episodes else None)
    lrs = sorted({lr for lr, _ in finals})
    methods = list(dict.fromkeys(m for _, m in finals))
    letter = exp.axis.split()[-1]
    lines = [f"![{name}]({png.relative_to(results)})", "",
             f"Breaking point: the lowest {exp.axis} at which at least {BREAK:.0%} of the seeds ({math.ceil(BREAK * 3)} of "
             f"3, {math.ceil(BREAK * 8)} of 8; at least {scale.seeds} seeds) collapsed (final held-out pass@1 at T = 1.0 "
             f"below {base - COLLAPSE:.3f}, the warm start's {base:.3f} minus {COLLAPSE}, or the run failed).", "",
             "| method | " + " | ".join(f"lr {lr_tag(lr)[2:]}" for lr in lrs) + " |", "|---" * (len(lrs) + 1) + "|"]
    lag_text = ", ".join(f"{letter} = {lv}: {statistics.mean(lags[lv]):.1f}" for lv in levels if lags.get(lv))
    notes, breaks = [], {}
    for m in methods:
        cells = [breaking(by_line.get((lr, m), {}), levels, letter, scale.seeds) for lr in lrs]
        breaks.update({(lr, m): lv for lr, (_, lv) in zip(lrs, cells)})
        lines.append(f"| {m} | " + " | ".join(text for text, _ in cells) + " |")
        notes += [n for lr, (_, lv) in zip(lrs, cells) if lv is not None for n in diagnosed.get((lr, m, lv), [])]
    lines.append("")
    if lag_text:
        lines += [f"The policy lag the runs trained at (optimizer steps, mean over steps and runs): {lag_text}.", ""]
    for lr in lrs:
        lines += [f"Final held-out pass@1 (T = 1.0), lr {lr_tag(lr)[2:]}: mean over seeds [95% bootstrap interval]; "
                  "collapsed seeds [95% Wilson interval].", "",
                  "| method | " + " | ".join(f"{letter} = {lv}" for lv in levels) + " |",
                  "|---" * (len(levels) + 1) + "|"]
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(by_line.get((lr, m), {}).get(lv, CellStats([], 0, 0)).text()
                                                 for lv in levels) + " |")
        lines.append("")
        for label, values in episodes.items():       # multi-turn: the episodes' reward, turns and the ESS
            lines += [f"{label[0].upper() + label[1:]}, lr {lr_tag(lr)[2:]}: mean +- std over seeds.", "",
                      "| method | " + " | ".join(f"{letter} = {lv}" for lv in levels) + " |",
                      "|---" * (len(levels) + 1) + "|"]
            lines += [f"| {m} | " + " | ".join(_mean_std(values.get((lr, m), {}).get(lv, [])) for lv in levels) + " |"
                      for m in methods]
            lines.append("")
    resolved, unresolved = [], []
    for (lr, m), lv in breaks.items():           # a break against the level below: the collapse counts
        if lv is None or levels.index(lv) == 0:
            continue
        at, below = by_line[(lr, m)][lv], by_line.get((lr, m), {}).get(levels[levels.index(lv) - 1])
        if below is None or not below.n:
            continue
        text = f"{m} at lr {lr_tag(lr)[2:]} ({at.collapsed}/{at.n} at {letter} = {lv}, {below.collapsed}/{below.n} below)"
        (resolved if apart(at.rate_ci(), below.rate_ci()) > 0 else unresolved).append(text)
    if resolved or unresolved:
        lines += [f"Breaks told from the level below by their collapse counts (Wilson intervals apart): "
                  f"{'; '.join(resolved) or 'none'}; not told apart: {'; '.join(unresolved) or 'none'}.", ""]
    lines += _stress_differences(name, exp, stats, scale, letter)
    if notes:
        lines += ["At each breaking point, the collapsed seeds' logs:", "", *notes, ""]
    return lines


def _stress_differences(name: str, exp, stats: dict[tuple[str, str], CellStats], scale: Scale,
                        letter: str) -> list[str]:
    """P3O's mean against every other method's at each learning rate and level: which are resolved."""
    cells = {c.label: c for c in exp.cells[:scale.cells]}
    groups: dict[tuple[float, int], tuple[list[str], list[str], list[str]]] = {}
    seen = []
    for a, b in pairs(name, exp):
        sa, sb = stats.get((name, a)), stats.get((name, b))
        if sa is None or sb is None or sa.mean_ci() is None or sb.mean_ci() is None or b not in cells:
            continue
        seen += [sa, sb]
        above, below, overlap = groups.setdefault((cell_lr(cells[a]), cells[a].level), ([], [], []))
        d = apart(sa.mean_ci(), sb.mean_ci())
        (above if d > 0 else below if d < 0 else overlap).append(f"{cells[b].method} {statistics.mean(sb.finals):.3f}")
    if not seen:
        return []
    out = [f"P3O's mean against each other method's at the same learning rate and {letter}, at "
           f"{_seed_counts(seen)} seeds per cell (95% bootstrap intervals apart or not):", ""]
    for (lr, lv), (above, below, overlap) in sorted(groups.items()):
        p3o = stats[(name, next(a for a, _ in pairs(name, exp) if cells[a].level == lv and cell_lr(cells[a]) == lr))]
        out.append(f"- lr {lr_tag(lr)[2:]}, {letter} = {lv} (P3O {statistics.mean(p3o.finals):.3f}): resolved above "
                   f"{', '.join(above) or 'none'}; resolved below {', '.join(below) or 'none'}; not resolved "
                   f"against {', '.join(overlap) or 'none'}.")
    return out + [""]


def claims(stats: dict[tuple[str, str], CellStats], scale: Scale, more: list[str] = ()) -> list[str]:
    """What the intervals support about the paper's claims, made from the same tests as the sections:
    P3O against the best baseline in every setting where both ran, where each method breaks, the remedy;
    `more`: bullets made elsewhere (whether a conclusion holds from other warm starts)."""
    rows, verdicts = [], {"above every baseline": 0, "above some, below none": 0, "below some": 0,
                          "not resolved against any": 0}
    for name, exp in EXPERIMENTS.items():
        groups: dict[str, list[str]] = {}
        for a, b in pairs(name, exp):
            if a.startswith("p3o") and not b.startswith("p3o"):
                groups.setdefault(a, []).append(b)
        for a, bs in groups.items():
            sa, sbs = stats.get((name, a)), [(b, stats.get((name, b))) for b in bs]
            sbs = [(b, s) for b, s in sbs if s is not None and s.mean_ci() is not None]
            if sa is None or sa.mean_ci() is None or not sbs:
                continue
            best, sb = max(sbs, key=lambda p: statistics.mean(p[1].finals))
            beaten = [b for b, s in sbs if apart(sa.mean_ci(), s.mean_ci()) > 0]    # P3O's interval above theirs
            beating = [b for b, s in sbs if apart(sa.mean_ci(), s.mean_ci()) < 0]   # and below
            verdict = ("above every baseline" if len(beaten) == len(sbs) else "below some" if beating else
                       "above some, below none" if beaten else "not resolved against any")
            verdicts[verdict] += 1
            named = [f"above {', '.join(f'`{b}`' for b in beaten)}"] if beaten and len(beaten) < len(sbs) else []
            named += [f"below {', '.join(f'`{b}`' for b in beating)}"] if beating else []
            rows.append(f"| {name}/`{a}` | {_mean_ci(sa.finals)} ({len(sa.finals)}) | `{best}` "
                        f"{_mean_ci(sb.finals)} ({len(sb.finals)}) | **{verdict}**"
                        f"{' (' + '; '.join(named) + ')' if named else ''} |")
    lines = ["## What this evidence says about the paper's claims", "",
             f"Only what the intervals above support, at this scale only (a 1.8M-parameter model, 2-digit addition, "
             f"{scale.steps} optimizer steps, CPU): a difference counts when the two 95% intervals do not overlap; "
             "an unresolved difference is not evidence that the methods are equal.", "",
             "**P3O matches or exceeds tuned baselines?** In each setting where both ran, P3O against every "
             "baseline there (GRPO at any clip, DAPO, decoupled PPO, GRPO + TIS or IcePop; the table shows the "
             "one with the highest mean): " + "; ".join(f"{v} in {k}" for v, k in verdicts.items())
             + f" (of {len(rows)} settings).", "",
             "| setting | P3O [95% CI] (seeds) | highest baseline [95% CI] (seeds) | P3O against the baselines |",
             "|---|---|---|---|", *rows, ""]
    for name, exp in EXPERIMENTS.items():        # where each method breaks, told apart by collapse counts
        if not exp.axis:
            continue
        by_line, levels = _lines(name, exp, stats, scale)
        letter = exp.axis.split()[-1]
        for lr in sorted({lr for lr, _ in by_line}):
            p3o = breaking(by_line.get((lr, "p3o"), {}), levels, letter, scale.seeds)[1]
            told, not_told = [], []
            for (l2, m), f in by_line.items():
                other = breaking(f, levels, letter, scale.seeds)[1]
                if l2 != lr or m in ("p3o", "p3o_no_kl") or other == p3o:
                    continue
                first = min(lv for lv in (other, p3o) if lv is not None)       # where one broke and the other not
                sp, so = by_line.get((lr, "p3o"), {}).get(first), f.get(first)
                if sp is None or so is None or not sp.n or not so.n:
                    continue
                verdict = f"{m} ({so.collapsed}/{so.n} vs P3O {sp.collapsed}/{sp.n} at {letter} = {first})"
                (told if apart(sp.rate_ci(), so.rate_ci()) else not_told).append(verdict)
            if told or not_told:
                lines.append(f"- **Breaking points, {name}, lr {lr_tag(lr)[2:]}** (P3O: "
                             f"{'none' if p3o is None else f'{letter} = {p3o}'}): P3O's break told apart from "
                             f"{'; '.join(told) or 'none'}; not told apart from {'; '.join(not_told) or 'none'}.")
    remedy = [(a, b) for a, b in PAIRS["temperature"] if a.endswith("_k4_anchor")]
    text = []
    for a, b in remedy:
        sa, sb = stats.get(("temperature", a)), stats.get(("temperature", b))
        if sa is None or sb is None or sa.mean_ci() is None or sb.mean_ci() is None:
            continue
        d = apart(sa.mean_ci(), sb.mean_ci())
        text.append(f"T = {a.split('_')[1][1:]}: {statistics.mean(sa.finals):.3f} vs {statistics.mean(sb.finals):.3f}, "
                    f"{'resolved above' if d > 0 else 'resolved below' if d < 0 else 'not resolved'}")
    if text:
        lines.append("- **The KL anchor at the trainer's temperature** (`kl_anchor: behavior_at_train_temperature` "
                     "against the paper's anchor pi_b, 4 steps per rollout): " + "; ".join(text) + ".")
    return lines + list(more) + [""]


def _verdict(a: CellStats, b: CellStats | None, seeds: int) -> str:
    """The remedy's interval against a reference's, when both have at least `seeds` finished seeds."""
    if b is None or not b.n:
        return "not run"
    if min(len(a.finals), len(b.finals)) < seeds:
        return "too few seeds"
    d = apart(a.mean_ci(), b.mean_ci())
    return "**above**" if d > 0 else "**below**" if d < 0 else "not resolved"


def remedy_table(summaries: Path, scale: Scale, stats0: dict | None = None) -> list[str]:
    """Every remedy against P3O and GRPO (eps 0.2) in the cells where P3O breaks, from every warm start run:
    one row per (setting, warm start, remedy), each difference resolved or not (a verdict only when both cells
    have at least `scale.seeds` finished seeds), and per remedy the count of rows where it is resolved below
    GRPO (eps 0.2): issue 39's goal is a remedy below it nowhere. `stats0`: warm start 0's cell stats, as the
    page's sections read them (None: read here)."""
    roots = {0: summaries} | {int(d.name[4:]): d for d in sorted(summaries.glob("warm*")) if d.name[4:].isdigit()}
    rows, tally, schemes = [], {}, set()
    for w, root in roots.items():
        if (base := _base(root, 1.0)) is None:
            continue
        stats = stats0 if w == 0 and stats0 is not None else cell_stats(root, base, scale)
        for name in REMEDY_EXPERIMENTS:
            cells = {c.label: c for c in EXPERIMENTS[name].cells[:scale.cells]}
            for cell in cells.values():
                ra = stats.get((name, cell.label))
                if cell.method not in REMEDIES_K or ra is None or not ra.n:
                    continue
                setting = cell.label.replace(cell.method + "_", "", 1)
                refs = [f"{m}_{setting}" for m in ("p3o", "grpo_eps0.2")]
                p3o, grpo = (stats.get((name, r)) for r in refs)
                vs = [_verdict(ra, p3o, scale.seeds), _verdict(ra, grpo, scale.seeds)]
                t = tally.setdefault(cell.method, {"rows": 0, "**above**": 0, "**below**": 0, "not resolved": 0,
                                                   "not run": 0, "too few seeds": 0})
                t["rows"] += 1
                t[vs[1]] += 1
                mark = {c: x.scheme if (x := stats.get((name, c))) else None for c in [cell.label] + refs if c in cells}
                schemes |= {v for v in mark.values() if v}
                tag = " ".join(f"({mark[c]})" if mark.get(c) else "" for c in [cell.label] + refs)
                cols = [x.text() if x is not None and x.finals else ("failed" if x is not None else "not run")
                        for x in (ra, p3o, grpo)]
                rows.append(f"| {name}/`{setting}` | {w} | `{cell.method}` | {cols[0]} | {cols[1]} | {cols[2]} | "
                            f"{vs[0]} | {vs[1]} | {tag.strip() if len(set(mark.values())) > 1 else ''} |")
    if not rows:
        return []
    lines = ["## Remedies against P3O and GRPO (eps 0.2) where P3O breaks", "",
             "Every remedy run, in every setting and from every warm start it ran from (the sections above have the "
             "curves): mean held-out pass@1 (T = 1.0) [95% bootstrap interval]; collapsed [95% Wilson interval] "
             "(its n: the seeds run; each reference's collapse line is its own experiment's warm start's); the "
             f"remedy's interval against each reference's, apart or not, stated when both have at least {scale.seeds} "
             "finished seeds. Where the cells' samples were drawn under different seed schemes, the last column "
             "names each cell's (remedy, P3O, GRPO): the same distribution, other draws.", "",
             "| setting | warm start | remedy | its result | P3O | GRPO (eps 0.2) | against P3O | "
             "against GRPO (eps 0.2) | seed schemes |",
             "|---|---|---|---|---|---|---|---|---|", *rows, ""]
    for m, t in tally.items():
        lines.append(f"- `{m}` against GRPO (eps 0.2), in {t['rows']} rows (setting x warm start): resolved above in "
                     f"{t['**above**']}, resolved below in {t['**below**']}, not resolved in {t['not resolved']}"
                     + (f", GRPO not run in {t['not run']}" if t["not run"] else "")
                     + (f", too few seeds in {t['too few seeds']}" if t["too few seeds"] else "") + ".")
    return lines + [""]


def _warm_starts(summaries: Path, scale: Scale, base: float) -> tuple[list[str], list[str]]:
    """The cells run from other warm starts (`warm<w>/` beside warm start 0's summaries): each cell's
    mean and collapses per warm start, and whether each tested difference comes out the same; and the
    claims section's bullet on it (empty without other warm starts)."""
    roots = {0: summaries} | {int(d.name[4:]): d for d in sorted(summaries.glob("warm*")) if d.name[4:].isdigit()}
    if len(roots) == 1:
        return [], []
    bases = {w: _base(root, 1.0) for w, root in roots.items()}
    stats = {w: cell_stats(root, b, scale) for w, root in roots.items() if (b := bases[w]) is not None}
    shown = sorted({key for w, st in stats.items() if w for key in st},
                   key=lambda k: (list(EXPERIMENTS).index(k[0]), k[1]))
    ws = sorted(stats)
    lines = ["## Warm starts", "",
             "The same cells from warm starts made with other SFT seeds (`--warm-starts`: model initialization, "
             "data order and label noise seeded with w; warm start 0 is the rest of this page). Each warm start's "
             "collapse line is its own held-out pass@1 (T = 1.0) minus "
             f"{COLLAPSE}. Cells: mean [95% bootstrap interval]; collapsed [95% Wilson interval].", "",
             "| cell | " + " | ".join(f"warm start {w} (from {bases[w]:.3f})" for w in ws) + " |",
             "|---" * (len(ws) + 1) + "|"]
    for name, label in shown:
        lines.append(f"| {name}/`{label}` | " + " | ".join(stats[w].get((name, label), CellStats([], 0, 0)).text()
                                                          for w in ws) + " |")
    verdicts, same_all, depends = [], [], []
    for name, exp in EXPERIMENTS.items():
        for a, b in pairs(name, exp):
            if (name, a) not in shown or (name, b) not in shown:
                continue
            per = []
            for w in ws:
                sa, sb = stats[w].get((name, a)), stats[w].get((name, b))
                if sa is None or sb is None or sa.mean_ci() is None or sb.mean_ci() is None:
                    continue
                d = apart(sa.mean_ci(), sb.mean_ci())
                per.append((w, "above" if d > 0 else "below" if d < 0 else "not resolved"))
            if len(per) > 1:
                alike = len({v for _, v in per}) == 1
                same = "the same from every warm start" if alike else "depends on the warm start"
                verdicts.append(f"- {name}/`{a}` against `{b}`: " + ", ".join(f"warm start {w} {v}" for w, v in per)
                                + f": {same}.")
                (same_all if alike else depends).append(
                    f"`{a}` vs `{b}` ({', '.join(v for _, v in per)})")
    claim = [f"- **Does a conclusion depend on the starting policy?** From {len(ws)} warm starts (held-out pass@1 "
             f"{', '.join(f'{bases[w]:.3f}' for w in ws)}; section above), the same from every one: "
             f"{'; '.join(same_all) or 'none'}; depends on the warm start: {'; '.join(depends) or 'none'}."
             ] if verdicts else []
    return lines + [""] + (verdicts + [""] if verdicts else []), claim


def write_report(summaries: Path, results: Path, scale: Scale, command: str) -> Path:
    """Write `results/results.md` and `results/img/experiments/<exp>.png` from every experiment's
    summaries under `summaries`; return the page's path."""
    base = _base(summaries, 1.0)
    if base is None:
        raise SystemExit(f"{summaries}/_base/val holds no summary of the warm start: run an experiment first")
    seconds = sum(json.loads(p.read_text())["seconds"] for p in summaries.rglob("summary.json")
                  if "seconds" in p.read_text())
    stats = cell_stats(summaries, base, scale)
    runs = sum(1 for p in summaries.rglob("summary.json") if "seconds" in p.read_text())
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
        f"at least {scale.seeds} seed(s) per cell (the seeds column says how many). Held out: {scale.val_prompts} "
        f"sums that no training prompt contains "
        f"(`Arithmetic(split: test)`), 4 samples each, every {scale.val_every} steps, sampled at T = 1.0 in "
        f"every run (`validation.sampling`: one ruler, whatever the run samples with); pass@1 is the unbiased "
        f"estimator. The warm start's held-out pass@1 at T = 1.0: **{base:.3f}**. Cells sampled at another "
        f"temperature are also evaluated once more after training at their own temperature, against the "
        f"warm start at it. A seed *collapsed* when its final held-out pass@1 (T = 1.0) is more than "
        f"{COLLAPSE} below the warm start's, or its run failed. The {runs} stored runs' wall times add up to "
        f"{seconds / 60:.1f} min (2 CPU cores; with `--jobs 2` two run at a time, one thread each).",
        "",
        f"Intervals: a cell's mean over seeds comes with a 95% percentile bootstrap interval ({RESAMPLES:,} "
        f"resamples of the seeds, RNG seed 0), a collapse count with a 95% Wilson interval; a difference is "
        f"*resolved* when the two intervals do not overlap. At 3 seeds the bootstrap interval is the seeds' "
        f"min..max (each extreme resample has probability 1/27 > 2.5%), which holds the true mean only about "
        f"75% of the time for a symmetric spread, and no collapse count can be told from another (0/3: "
        f"[0.00, 0.56], 3/3: [0.44, 1.00]); at 8 seeds 0/8 [0.00, 0.32] and 6/8 [0.41, 0.93] are apart.",
        "",
    ]
    for name, exp in EXPERIMENTS.items():
        lines += [f"## {exp.title}", "", exp.question, "", f"`python -m experiments.run {name}`", ""]
        if exp.size:
            own = exp.sized(scale)
            lines += [f"This experiment's runs are smaller than the rest: {own.prompts} prompts x {own.samples} "
                      f"samples per rollout, {own.steps} optimizer steps, held out every {own.val_every} steps.", ""]
        if not any(_runs(summaries, name, c) != ([], 0) for c in exp.cells[:scale.cells]):
            lines += ["Not run yet (no summaries).", ""]
            continue
        own_base = _base(summaries, 1.0, name)
        if own_base != base:
            lines += [f"This experiment's runs started from another warm start (the same config, made again): its "
                      f"held-out pass@1 at T = 1.0 is **{own_base:.3f}**, the collapse line {own_base - COLLAPSE:.3f}.", ""]
        section = _stress_section if exp.axis else _section
        lines += section(name, exp, summaries, results, scale, own_base, stats)
        lines += [seed_schemes(name, exp, summaries, scale), ""]
    warm, warm_claim = _warm_starts(summaries, scale, base)
    lines += warm + remedy_table(summaries, scale, stats) + claims(stats, scale, warm_claim)
    page = results / "results.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    return page
