"""Run the experiments: one command per experiment, one for all; finished runs are skipped.

    python -m experiments.run all                 # every experiment, 3 seeds (docs/results.md)
    python -m experiments.run clip staleness      # some of them (or --only clip --only staleness)
    python -m experiments.run --report-only       # the page from the stored summaries alone, no run
    python -m experiments.run all --quick         # 1 seed, 4 steps, the first cell of each: proves the pipeline (CI)

Runs land in `runs/experiments/<experiment>/<cell>/seed<k>/` (`--quick`: runs/experiments-quick): the
config (`config.yaml`, rerun it with `lit-ess fit --config`), TensorBoard files, `metrics.csv`, and
`done.json` (wall time). A run whose `done.json` sits beside the same `config.yaml` is skipped (a cell
whose config changed runs again); a failed run leaves `failed.txt`
(the end of its stderr), is counted in the report, and is tried again next time.

Each finished run also leaves a small summary, kept in the repository: `experiments/results/<experiment>/
<cell>/seed<k>/` (`summary.json`: wall time and final metrics; `curves.csv`: the scalars the page
plots, a row per step). The page is always made from every experiment's summaries, so one experiment can be rerun
alone (in a fresh checkout nothing is in runs/, so naming it reruns it) and the rest of the page stays.

First, once: the tiny model and its supervised warm start (`_base/`), and the warm start's held-out
pass@k (`_base/val`), the line every plot starts from. Then every cell x seed, then the report
(experiments/report.py): plots and the results page.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from lit_ess.console import quiet_console

from .cells import EXPERIMENTS, FULL, K, QUICK, TEMPERATURE, Scale, apply, base_config, base_folder, temperature
from .report import read_csv, write_report

ROOT = Path(__file__).resolve().parents[1]
SUMMARIES = ROOT / "experiments" / "results"
# the scalars a summary keeps (the plots' and the collapse diagnosis'), rounded to 5 digits
KEEP = ("rollout/reward_mean", "val/pass@1", "val/pass@4", "train/ess", "train/ratio_max", "train/kl_behavior",
        "rollout/response_len", "train/grad_norm", "train/policy_lag", "train/policy_lag_max",
        "rollout/turns", "rollout/truncated_turns")     # the last two: multi-turn episodes (data.env)


def lit_ess(args: list[str], log: Path, threads: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if threads:                  # several runs at once: split the cores, never oversubscribe them
        env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "lit_ess.cli", *args], cwd=ROOT, env=env, stdout=f,
                              stderr=subprocess.STDOUT, text=True)


def write_yaml(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def prepare_base(out: Path, scale: Scale, threads: int | None = None) -> Path:
    """The tiny model, its SFT warm start (30% wrong labels: samples the right sum about half the time)."""
    base = out / "_base"
    sft = base / "sft"
    if (sft / "config.json").exists() and (base / "sft.done").exists():
        return sft
    from lit_ess.tiny import build_tiny_model

    build_tiny_model(base / "init")
    cfg = yaml.safe_load((ROOT / "configs" / "demo_sft.yaml").read_text())
    apply(cfg, {"model.init_args.model_path": str(base / "init"), "trainer.max_steps": scale.sft_steps,
                "trainer.logger.init_args.save_dir": str(base), "trainer.logger.init_args.version": "sft",
                "trainer.callbacks": [{"class_path": "lit_ess.callbacks.ExportHF", "init_args": {"dirpath": str(sft)}}],
                "trainer.enable_progress_bar": False})
    print(f"[base] supervised warm start, {scale.sft_steps} steps -> {sft}", flush=True)
    res = lit_ess(["fit", "--config", str(write_yaml(cfg, base / "sft.yaml"))], base / "sft.log", threads)
    if res.returncode != 0:
        raise SystemExit(f"the warm start failed: see {base / 'sft.log'}")
    (base / "sft.done").write_text("ok\n")
    return sft


def base_dir(out: Path, temp: float) -> Path:
    return out / "_base" / base_folder(temp)


def validate(model: Path, d: Path, scale: Scale, temp: float, threads: int | None = None) -> None:
    """Held-out metrics of `model` (`lit-ess validate`) sampled at `temp`, into `d/metrics.csv`."""
    cfg = apply(base_config(str(model), str(d), 0, scale), {TEMPERATURE: temp, "data.init_args.val_sampling": None})
    res = lit_ess(["validate", "--config", str(write_yaml(cfg, d / "config.yaml"))], d / "log.txt", threads)
    if res.returncode != 0:
        raise RuntimeError(f"validation failed: see {d / 'log.txt'}")
    export_csv(d / "tb", d / "metrics.csv")


def base_validation(out: Path, sft: Path, scale: Scale, summaries: Path, threads: int | None = None,
                    temp: float = 1.0) -> Path:
    """Held-out metrics of the warm start sampled at `temp`: the step-0 point of every curve (T = 1.0),
    and the baseline of the cells evaluated at their own temperature."""
    d = base_dir(out, temp)
    if not ((d / "metrics.csv").exists() and "val/pass@1" in (d / "metrics.csv").read_text()):
        try:
            validate(sft, d, scale, temp, threads)
        except RuntimeError as e:
            raise SystemExit(f"the warm start's {e}")
    summarize(d, base_dir(summaries, temp), {})
    return d


def summarize(d: Path, dest: Path, summary: dict) -> None:
    """The run's small summary: `curves.csv` (the KEEP scalars) and `summary.json` (`summary` plus the
    final value of every kept scalar)."""
    curves = {t: dict(v) for t, v in read_csv(d / "metrics.csv").items() if t in KEEP}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "failed.txt").unlink(missing_ok=True)
    tags = sorted(curves)
    with open(dest / "curves.csv", "w", newline="") as f:     # a row per step, a column per scalar
        w = csv.writer(f)
        w.writerow(["step", *tags])
        for step in sorted(set().union(*curves.values())):
            w.writerow([step, *(f"{curves[t][step]:.5g}" if step in curves[t] else "" for t in tags)])
    curves = {t: sorted(v.items()) for t, v in curves.items()}
    summary = {**summary, "final": {t: round(v[-1][1], 5) for t, v in sorted(curves.items())}}
    (dest / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def export_csv(tb_dir: Path, path: Path) -> None:
    """Every scalar of the run as rows (tag, step, value)."""
    from lit_ess.report import read_scalars

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "step", "value"])
        for tag, points in sorted(read_scalars(tb_dir).items()):
            w.writerows((tag, step, value) for step, value in points)


def canonical(exp_name: str, cell) -> tuple[str, object]:
    """The experiment and cell a run belongs to (a cell `same_as` another is run and stored there)."""
    if cell.same_as is None:
        return exp_name, cell
    name, label = cell.same_as.split("/")
    return name, next(c for c in EXPERIMENTS[name].cells if c.label == label)


def cell_config(exp_name: str, cell, seed: int, sft: Path, d: Path, scale: Scale) -> dict:
    exp = EXPERIMENTS[exp_name]
    scale = exp.sized(scale)
    cfg = apply(apply(base_config(str(sft), str(d), seed, scale), exp.common), cell.overrides)
    if exp.batch_per_step:        # the same rows per optimizer step at every k: the rollout grows with k
        cfg["data"]["init_args"]["prompts_per_rollout"] = scale.prompts * int(cell.overrides.get(K, 1))
    if temperature(cell) != 1.0:  # its weights, for the evaluation at its own temperature
        cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.ExportHF",
                                            "init_args": {"dirpath": str(d / "final")}})
    return cfg


def run_cell(exp_name: str, cell, seed: int, sft: Path, out: Path, summaries: Path, scale: Scale,
             threads: int | None = None) -> str:
    """Run one cell x seed unless it already ran with this very config (`done.json` beside the same
    `config.yaml`; a changed cell reruns), and leave its summary under `summaries`."""
    exp_name, cell = canonical(exp_name, cell)
    d, dest = (root / exp_name / cell.label / f"seed{seed}" for root in (out, summaries))
    text = yaml.safe_dump(cell_config(exp_name, cell, seed, sft, d, scale), sort_keys=False)
    if (d / "done.json").exists() and (d / "config.yaml").exists() and (d / "config.yaml").read_text() == text:
        if not (dest / "summary.json").exists():          # e.g. another --summaries folder
            summarize_run(d, dest, cell)
        return "skipped"
    (d / "done.json").unlink(missing_ok=True)
    (d / "failed.txt").unlink(missing_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(text)
    t0 = time.time()
    res = lit_ess(["fit", "--config", str(d / "config.yaml")], d / "log.txt", threads)
    log = d / "log.txt"
    try:
        if res.returncode != 0:
            raise RuntimeError(f"training failed: see {log}")
        export_csv(d / "tb", d / "metrics.csv")
        if (temp := temperature(cell)) != 1.0:
            log = d / "own_val" / "log.txt"
            validate(d / "final", d / "own_val", scale, temp, threads)
    except RuntimeError:
        tail = log.read_text()[-4000:]
        (d / "failed.txt").write_text(tail)
        dest.mkdir(parents=True, exist_ok=True)
        for old in ("summary.json", "curves.csv"):
            (dest / old).unlink(missing_ok=True)
        (dest / "failed.txt").write_text(tail[-1500:])
        return "failed"
    (d / "done.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1)}) + "\n")
    summarize_run(d, dest, cell)
    return "done"


def summarize_run(d: Path, dest: Path, cell) -> None:
    """A finished run's summary from its folder: wall time, and the evaluation at its own temperature."""
    summary = {"seconds": json.loads((d / "done.json").read_text())["seconds"]}
    if (temp := temperature(cell)) != 1.0:
        own = read_csv(d / "own_val" / "metrics.csv")["val/pass@1"][-1][1]
        summary["own_temperature"] = {"temperature": temp, "val/pass@1": round(own, 5)}
    summarize(d, dest, summary)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"'all' or some of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="an experiment to run (repeatable)")
    p.add_argument("--report-only", action="store_true", help="no run: the page from the stored summaries")
    p.add_argument("--quick", action="store_true", help="1 seed, 4 steps, a short warm start (CI)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; --quick: 1)")
    p.add_argument("--out", default=None, help="runs folder (default runs/experiments, or runs/experiments-quick)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each with cores / jobs threads")
    p.add_argument("--results", default=None, help="folder of the results page and plots (default docs/, "
                   "or the runs folder with --quick)")
    p.add_argument("--summaries", default=None, help="folder of the runs' summaries (default experiments/results, "
                   "or <runs folder>/summaries with --quick)")
    a = p.parse_args(argv)
    quiet_console()
    names = a.names + a.only
    names = list(EXPERIMENTS) if names == ["all"] else names
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; choose from {', '.join(EXPERIMENTS)} or all")
    if not names and not a.report_only:
        p.error("name experiments to run ('all' for every one), or --report-only")
    scale = QUICK if a.quick else FULL
    if a.seeds:
        scale = Scale(**{**scale.__dict__, "seeds": a.seeds})
    out = (ROOT / (a.out or ("runs/experiments-quick" if a.quick else "runs/experiments"))).resolve()
    results = Path(a.results).resolve() if a.results else (out if a.quick else ROOT / "docs")
    summaries = Path(a.summaries).resolve() if a.summaries else (out / "summaries" if a.quick else SUMMARIES)
    command = "python -m experiments.run " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.report_only:
        print(f"results: {write_report(summaries, results, scale, command)}", flush=True)
        return
    t0 = time.time()
    threads = max(1, (os.cpu_count() or 1) // a.jobs) if a.jobs > 1 else None
    sft = prepare_base(out, scale, threads)
    for temp in sorted({temperature(c) for n in names for c in EXPERIMENTS[n].cells[:scale.cells]} | {1.0}):
        d = base_validation(out, sft, scale, summaries, threads, temp)
        for name in names:        # beside the experiment's runs too: the page's warm start may be another one's
            summarize(d, base_dir(summaries / name, temp), {})
    counts = {"done": 0, "skipped": 0, "failed": 0}
    todo = {}                     # a run shared by two experiments (`same_as`) is run once
    for name in names:
        for cell in EXPERIMENTS[name].cells[:scale.cells]:
            for seed in range(scale.seeds):
                run_name, run_cell_ = canonical(name, cell)
                todo.setdefault((run_name, run_cell_.label, seed), (name, cell, seed))

    def one(job):
        name, cell, seed = job
        t1 = time.time()
        status = run_cell(name, cell, seed, sft, out, summaries, scale, threads)
        print(f"[{name}] {cell.label} seed {seed}: {status} ({time.time() - t1:.0f} s)", flush=True)
        return status

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for status in pool.map(one, todo.values()):
            counts[status] += 1
    page = write_report(summaries, results, scale, command)
    print(f"{counts['done']} run, {counts['skipped']} skipped, {counts['failed']} failed in {time.time() - t0:.0f} s; "
          f"results: {page}", flush=True)
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
