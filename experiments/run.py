"""Run the experiments: one command per experiment, one for all; finished runs are skipped.

    python -m experiments.run all                 # every experiment, 3 seeds (docs/results.md)
    python -m experiments.run clip staleness      # some of them
    python -m experiments.run all --quick         # 1 seed, 4 steps, the first cell of each: proves the pipeline (CI)

Runs land in `runs/experiments/<experiment>/<cell>/seed<k>/` (`--quick`: runs/experiments-quick): the
config (`config.yaml`, rerun it with `lit-ess fit --config`), TensorBoard files, `metrics.csv`, and
`done.json` (wall time). A run whose `done.json` exists is skipped; a failed run leaves `failed.txt`
(the end of its stderr), is counted in the report, and is tried again next time.

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

from .cells import EXPERIMENTS, FULL, QUICK, TEMPERATURE, Scale, apply, base_config, temperature

ROOT = Path(__file__).resolve().parents[1]


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
    return out / "_base" / ("val" if temp == 1.0 else f"val_T{temp}")


def base_validation(out: Path, sft: Path, scale: Scale, threads: int | None = None, temp: float = 1.0) -> Path:
    """Held-out metrics of the warm start (`lit-ess validate`) sampled at `temp`, the step-0 point of
    every curve whose runs sample (and so validate) at that temperature."""
    d = base_dir(out, temp)
    if (d / "metrics.csv").exists() and "val/pass@1" in (d / "metrics.csv").read_text():
        return d
    cfg = apply(base_config(str(sft), str(d), 0, scale), {TEMPERATURE: temp})
    res = lit_ess(["validate", "--config", str(write_yaml(cfg, d / "config.yaml"))], d / "log.txt", threads)
    if res.returncode != 0:
        raise SystemExit(f"validation of the warm start failed: see {d / 'log.txt'}")
    export_csv(d / "tb", d / "metrics.csv")
    return d


def export_csv(tb_dir: Path, path: Path) -> None:
    """Every scalar of the run as rows (tag, step, value)."""
    from lit_ess.report import read_scalars

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag", "step", "value"])
        for tag, points in sorted(read_scalars(tb_dir).items()):
            w.writerows((tag, step, value) for step, value in points)


def run_cell(exp_name: str, cell, seed: int, sft: Path, out: Path, scale: Scale, threads: int | None = None) -> str:
    d = out / exp_name / cell.label / f"seed{seed}"
    if (d / "done.json").exists():
        return "skipped"
    exp = EXPERIMENTS[exp_name]
    cfg = apply(apply(base_config(str(sft), str(d), seed, scale), exp.common), cell.overrides)
    (d / "failed.txt").unlink(missing_ok=True)
    t0 = time.time()
    res = lit_ess(["fit", "--config", str(write_yaml(cfg, d / "config.yaml"))], d / "log.txt", threads)
    if res.returncode != 0:
        tail = (d / "log.txt").read_text()[-4000:]
        (d / "failed.txt").write_text(tail)
        return "failed"
    export_csv(d / "tb", d / "metrics.csv")
    (d / "done.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1)}) + "\n")
    return "done"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", help=f"'all' or some of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--quick", action="store_true", help="1 seed, 4 steps, a short warm start (CI)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; --quick: 1)")
    p.add_argument("--out", default=None, help="runs folder (default runs/experiments, or runs/experiments-quick)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each with cores / jobs threads")
    p.add_argument("--results", default=None, help="folder of the results page and plots (default docs/, "
                   "or the runs folder with --quick)")
    a = p.parse_args(argv)
    quiet_console()
    names = list(EXPERIMENTS) if a.names == ["all"] else a.names
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; choose from {', '.join(EXPERIMENTS)} or all")
    scale = QUICK if a.quick else FULL
    if a.seeds:
        scale = Scale(**{**scale.__dict__, "seeds": a.seeds})
    out = (ROOT / (a.out or ("runs/experiments-quick" if a.quick else "runs/experiments"))).resolve()
    results = Path(a.results).resolve() if a.results else (out if a.quick else ROOT / "docs")
    t0 = time.time()
    threads = max(1, (os.cpu_count() or 1) // a.jobs) if a.jobs > 1 else None
    sft = prepare_base(out, scale, threads)
    for temp in sorted({temperature(c) for n in names for c in EXPERIMENTS[n].cells[:scale.cells]} | {1.0}):
        base_validation(out, sft, scale, threads, temp)
    counts = {"done": 0, "skipped": 0, "failed": 0}
    todo = [(name, cell, seed) for name in names for cell in EXPERIMENTS[name].cells[:scale.cells]
            for seed in range(scale.seeds)]

    def one(job):
        name, cell, seed = job
        t1 = time.time()
        status = run_cell(name, cell, seed, sft, out, scale, threads)
        print(f"[{name}] {cell.label} seed {seed}: {status} ({time.time() - t1:.0f} s)", flush=True)
        return status

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for status in pool.map(one, todo):
            counts[status] += 1
    from .report import write_report

    command = "python -m experiments.run " + " ".join(argv if argv is not None else sys.argv[1:])
    page = write_report(out, results, names, scale, command)
    print(f"{counts['done']} run, {counts['skipped']} skipped, {counts['failed']} failed in {time.time() - t0:.0f} s; "
          f"results: {page}", flush=True)
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
