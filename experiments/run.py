"""Run the experiments: one command per experiment, one for all; finished runs are skipped.

    python -m experiments.run all                 # every experiment, 3 seeds (docs/results.md)
    python -m experiments.run clip staleness      # some of them (or --only clip --only staleness)
    python -m experiments.run --report-only       # the page from the stored summaries alone, no run
    python -m experiments.run all --quick         # 1 seed, 4 steps, the first cell of each: proves the pipeline (CI)
    python -m experiments.run --select decisive --seeds 0-7 --jobs 2          # more seeds where they decide something
    python -m experiments.run --select headline --seeds 0-7 --warm-starts 1,2 # the headline cells from other warm starts
    python -m experiments.run --select resolved --seeds 0-7 --jobs 2          # more seeds behind every difference called
    python -m experiments.run --cells 'stress_s/p3o_*' --seeds 3,4            # cells by pattern (<experiment>/<cell>)

Runs land in `runs/experiments/<experiment>/<cell>/seed<k>/` (`--quick`: runs/experiments-quick): the
config (`config.yaml`, rerun it with `lit-ess fit --config`), TensorBoard files, `metrics.csv`, and
`done.json` (wall time, seed scheme). A run whose `done.json` sits beside the same `config.yaml` is skipped (a cell
whose config changed runs again); a failed run leaves `failed.txt`
(the end of its stderr), is counted in the report, and is tried again next time.

Each finished run also leaves a small summary, kept in the repository: `experiments/results/<experiment>/
<cell>/seed<k>/` (`summary.json`: wall time, config digest, seed scheme and final metrics; `curves.csv`: the scalars the page
plots, a row per step). The page is always made from every experiment's summaries, so one experiment can be rerun
alone and the rest of the page stays. A summary records its config's digest: in a checkout without the run's
folder (runs/ is not in the repository) a summary with the same digest counts as the run made, others run again
(to make a run again, delete its summary).

`--seeds` takes a count (`8`: seeds 0-7) or seeds (`0-7`, `0,3,5-7`); a run's config depends only on its cell,
seed and warm start, so adding seeds never reruns the ones made. `--warm-starts 0,1,2` repeats every
run from warm starts made with those SFT seeds (model init, data order and label noise); warm start 0 is
the one described here, warm start w > 0 lives apart under `<runs>/warm<w>/` and `<summaries>/warm<w>/`
with the same layout, and the page compares them in its own section.

First, once: the tiny model and its supervised warm start (`_base/`), and the warm start's held-out
pass@k (`_base/val`), the line every plot starts from. Then every cell x seed, then the report
(experiments/report.py): plots and the results page.
"""
from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from lit_ess.console import quiet_console
from lit_ess.sampling import SEED_SCHEME

from .cells import EXPERIMENTS, FULL, K, QUICK, TEMPERATURE, Scale, apply, base_config, base_folder, temperature
from .report import LEGACY_SEED_SCHEME, decisive, read_csv, resolved, write_report

ROOT = Path(__file__).resolve().parents[1]
SUMMARIES = ROOT / "experiments" / "results"
# the scalars a summary keeps (the plots' and the collapse diagnosis'), rounded to 5 digits
KEEP = ("rollout/reward_mean", "val/pass@1", "val/pass@4", "train/ess", "train/ratio_max", "train/kl_behavior",
        "rollout/response_len", "train/grad_norm", "train/policy_lag", "train/policy_lag_max",
        "rollout/turns", "rollout/truncated_turns",     # multi-turn episodes (data.env)
        "rollout/multi_version_frac", "train/token_lag",  # in-flight updates: rows of 2+ versions, mean token lag
        # the mechanism experiment's traces (lit_ess/gradient_profile.py), kept wherever a run logs them
        "train/capped_frac", "train/kl_term", "train/kl_grad_share", "train/kl_grad_cos", "train/grad_scale",
        "train/grad_share_rho_lo", "train/grad_share_rho_hi", "train/grad_share_neg_adv", "train/sample_nll",
        "train/ratio_p05", "train/ratio_p95")


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


def parse_seeds(text: str) -> list[int]:
    """`--seeds` / `--warm-starts`: a count N (0..N-1), or seeds and ranges, `0-7`, `0,3,5-7` (one seed k: `k-k`)."""
    if text.strip().isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"a count of at least 1, got {text!r} (the one seed k alone: k-k)")
        return list(range(int(text)))
    out = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        ok = lo.isdigit() and (hi.isdigit() and int(hi) >= int(lo) if dash else not hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a seed or a range lo-hi (e.g. 0-7 or 0,3,5-7)")
        out += [k for k in range(int(lo), int(hi or lo) + 1) if k not in out]
    return out


def warm_root(root: Path, warm: int) -> Path:
    """Where warm start `warm`'s runs or summaries live: warm start 0 at the root (the page's own), others apart."""
    return root if warm == 0 else root / f"warm{warm}"


_IN_PROCESS = threading.Lock()


def prepare_base(out: Path, scale: Scale, threads: int | None = None, warm: int = 0) -> Path:
    """The tiny model, its SFT warm start (30% wrong labels: samples the right sum about half the time).
    `warm`: the SFT seed (initial weights, data order, which labels are wrong); 0 is configs/demo_sft.yaml's."""
    base = out / "_base"
    sft = base / "sft"
    if (sft / "config.json").exists() and (base / "sft.done").exists():
        return sft
    with _IN_PROCESS:       # torch's global RNG seeds the init: one warm start's build at a time
        from lit_ess.tiny import build_tiny_model

        build_tiny_model(base / "init", seed=warm)
    cfg = yaml.safe_load((ROOT / "configs" / "demo_sft.yaml").read_text())
    if warm:
        apply(cfg, {"seed_everything": warm, "data.init_args.seed": warm})
    apply(cfg, {"model.init_args.model_path": str(base / "init"), "trainer.max_steps": scale.sft_steps,
                "output_dir": None,          # its paths are named here: the model in _base/sft, as the runs expect
                "trainer.logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                   "init_args": {"save_dir": str(base), "name": "tb", "version": "sft"}},
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
    cfg = apply(base_config(str(model), str(d), 0, scale), {TEMPERATURE: temp, "data.init_args.validation.sampling": None})
    res = lit_ess(["validate", "--config", str(write_yaml(cfg, d / "config.yaml"))], d / "log.txt", threads)
    if res.returncode != 0:
        raise RuntimeError(f"validation failed: see {d / 'log.txt'}")
    export_csv(d / "tb", d / "metrics.csv")


def base_validation(out: Path, sft: Path, scale: Scale, summaries: Path, threads: int | None = None,
                    temp: float = 1.0) -> None:
    """Held-out metrics of the warm start sampled at `temp`: the step-0 point of every curve (T = 1.0),
    and the baseline of the cells evaluated at their own temperature."""
    d = base_dir(out, temp)
    if not ((d / "metrics.csv").exists() and "val/pass@1" in (d / "metrics.csv").read_text()):
        try:
            validate(sft, d, scale, temp, threads)
        except RuntimeError as e:
            raise SystemExit(f"the warm start's {e}")
    dest = base_dir(summaries, temp)
    here, weights = read_csv(d / "metrics.csv")["val/pass@1"][-1][1], weights_sha256(sft)
    stored = json.loads((dest / "summary.json").read_text()) if (dest / "summary.json").exists() else None
    # the same warm start: the same weights (its SFT is deterministic here: a rebuilt one equals the stored one
    # bit for bit), recorded in the summary; a summary without them: the same held-out pass@1 (a number that
    # also depends on how the evaluation's samples are seeded, lit_ess.sampling.SEED_SCHEME)
    same = stored is None or (stored["weights_sha256"] == weights if "weights_sha256" in stored
                              else abs(stored["final"]["val/pass@1"] - here) <= 1e-4)
    if not same:
        was = stored.get("weights_sha256", f"held-out pass@1 {stored['final']['val/pass@1']:.5f}")
        raise SystemExit(f"the warm start in {out / '_base'} (weights {weights[:12]}, held-out pass@1 {here:.5f} at T = "
                         f"{temp}) is not the one the summaries in {summaries} were made from ({was[:24]}): its runs "
                         f"would mix two starting policies. Bring that warm start's {out / '_base'} here, or start the "
                         f"page over (another --summaries folder, or remove {summaries})")
    if stored is None:                 # the stored one stays the page's step-0 point (as evaluated when it was made)
        summarize(d, dest, {"weights_sha256": weights, "seed_scheme": SEED_SCHEME})


def weights_sha256(model: Path) -> str:
    """sha256 of a model folder's weight files (*.safetensors, by name): which warm start it is."""
    h = hashlib.sha256()
    for f in sorted(model.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


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
        cfg["data"]["init_args"]["batch"]["prompts_per_rollout"] = scale.prompts * int(cell.overrides.get(K, 1))
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
    digest = config_digest(exp_name, cell, seed, scale)
    if made(d, dest, text, digest):
        if not (dest / "summary.json").exists():          # e.g. another --summaries folder
            summarize_run(d, dest, cell, digest)
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
    (d / "done.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1), "seed_scheme": SEED_SCHEME}) + "\n")
    summarize_run(d, dest, cell, digest)
    return "done"


def made(d: Path, dest: Path, text: str, digest: str) -> bool:
    """Whether the run exists already: its folder `d` finished with this very config (`text`), or, with no
    folder (another machine made it), its summary in `dest` records this config's digest."""
    if (d / "done.json").exists() and (d / "config.yaml").exists() and (d / "config.yaml").read_text() == text:
        return True
    return not d.exists() and (dest / "summary.json").exists() and \
        json.loads((dest / "summary.json").read_text()).get("config_sha256") == digest


def config_digest(exp_name: str, cell, seed: int, scale: Scale) -> str:
    """sha256 of the run's config with its folders left out: what a stored summary was made from, so a
    checkout without the run's folder (the summaries are in the repository, runs/ is not) can reuse it."""
    cfg = cell_config(exp_name, cell, seed, Path("<warm start>"), Path("<run>"), scale)
    return hashlib.sha256(yaml.safe_dump(cfg, sort_keys=True).encode()).hexdigest()


def summarize_run(d: Path, dest: Path, cell, digest: str) -> None:
    """A finished run's summary from its folder: wall time, the config's digest, how its samples were seeded
    (`seed_scheme`, lit_ess.sampling.SEED_SCHEME when it ran; a run finished before the field: "per-sample"),
    and the evaluation at its own temperature. The scheme is not in the digest: a stored run drawn per sample
    stays made (the same config, other draws of the same distribution), and the page says which it was."""
    done = json.loads((d / "done.json").read_text())
    summary = {"seconds": done["seconds"], "config_sha256": digest,
               "seed_scheme": done.get("seed_scheme", LEGACY_SEED_SCHEME)}
    if (temp := temperature(cell)) != 1.0:
        own = read_csv(d / "own_val" / "metrics.csv")["val/pass@1"][-1][1]
        summary["own_temperature"] = {"temperature": temp, "val/pass@1": round(own, 5)}
    summarize(d, dest, summary)


# The cells the page's headline differences rest on: P3O against GRPO eps 0.2 and 0.6 at S = 4 and 8
# (lr 5e-4), and the KL-anchor remedy at T = 1.5; the ones to repeat from other warm starts.
HEADLINE = [f"stress_s/{m}_lr5e-4_S{s}" for s in (4, 8) for m in ("p3o", "grpo_eps0.2", "grpo_eps0.6")] + \
           ["temperature/p3o_T1.5_processed_k4", "temperature/p3o_T1.5_processed_k4_anchor"]
REMEDY = "temperature/p3o_T*_processed_k4*"


def selection(name: str, summaries: Path, scale: Scale) -> list[str]:
    """A named set of cells (`<experiment>/<cell>` patterns). `headline`: HEADLINE. `decisive`: every
    stress line's breaking level and the level below, from the stored summaries (report.decisive; rerun
    after new seeds, a break may move), the headline cells and the remedy cells at every temperature.
    `resolved`: both cells of every difference the page calls resolved (report.resolved)."""
    if name == "headline":
        return list(HEADLINE)
    if name == "resolved":
        return [f"{e}/{c}" for e, c in resolved(summaries, scale)]
    return [f"{e}/{c}" for e, c in decisive(summaries, scale)] + HEADLINE + [REMEDY]


SELECTIONS = ("decisive", "headline", "resolved")


def plan(names: list[str], include: list[str], only: list[str], scale: Scale, seeds: list[int],
         warm_starts: list[int]) -> list[tuple[int, str, object, int]]:
    """The runs to make, (warm start, experiment, cell, seed), each once: the named experiments' cells and
    those matching an `include` pattern (every cell when neither is given), narrowed to those matching an
    `only` pattern when there is one (fnmatch on `<experiment>/<cell>`); a cell `same_as` another is run
    (and stored) under that one."""
    def match(key: str, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(key, q) for q in patterns)

    cells = [(n, c) for n, e in EXPERIMENTS.items() for c in e.cells[:scale.cells]
             if (n in names or match(f"{n}/{c.label}", include) or not (names or include))
             and (not only or match(f"{n}/{c.label}", only))]
    todo = {}
    for warm in warm_starts:
        for name, cell in cells:
            for seed in seeds:
                run_name, run_cell_ = canonical(name, cell)
                todo.setdefault((warm, run_name, run_cell_.label, seed), (warm, name, cell, seed))
    return list(todo.values())


def estimate(todo: list, out: Path, summaries: Path, scale: Scale, jobs: int) -> str:
    """How many of the planned runs are to make, and how long they take: each at the mean wall time of
    its experiment's stored runs (made with --jobs 2, a thread each), `jobs` at a time."""
    seconds: dict[str, list[float]] = {}
    for path in summaries.glob("*/*/seed*/summary.json"):
        if "seconds" in (summary := json.loads(path.read_text())):
            seconds.setdefault(path.parts[-4], []).append(summary["seconds"])
    overall = [x for v in seconds.values() for x in v]
    new, total = [], 0.0
    for warm, name, cell, seed in todo:
        run_name, run = canonical(name, cell)
        d, dest = (warm_root(root, warm) / run_name / run.label / f"seed{seed}" for root in (out, summaries))
        text = yaml.safe_dump(cell_config(run_name, run, seed, warm_root(out, warm) / "_base" / "sft", d, scale),
                              sort_keys=False)
        if not made(d, dest, text, config_digest(run_name, run, seed, scale)):
            new.append(warm)
            per = seconds.get(run_name) or overall
            total += sum(per) / len(per) if per else float("nan")
    warm_new = sorted({w for w in new if not (warm_root(out, w) / "_base" / "sft.done").exists()})
    return (f"{len(todo)} runs planned, {len(todo) - len(new)} already made, {len(new)} to make: about "
            f"{total / 3600:.1f} h of run time, {total / 3600 / jobs:.1f} h of wall time at --jobs {jobs} "
            f"(each at its experiment's mean stored wall time)"
            + (f", plus the warm start(s) {warm_new} to make first (a {scale.sft_steps}-step SFT each)" if warm_new else ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"'all' or some of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="an experiment to run (repeatable)")
    p.add_argument("--report-only", action="store_true", help="no run: the page from the stored summaries")
    p.add_argument("--quick", action="store_true", help="1 seed, 4 steps, a short warm start (CI)")
    p.add_argument("--seeds", type=parse_seeds, default=None, metavar="SEEDS",
                   help="a count (default 3, --quick 1: seeds 0..N-1) or seeds: 0-7, 0,3,5-7")
    p.add_argument("--warm-starts", type=parse_seeds, default=[0], metavar="SEEDS",
                   help="SFT seeds of the warm starts to run from (default 0; others stored under warm<w>/): 0,1,2")
    p.add_argument("--cells", action="append", default=[], metavar="PATTERN",
                   help="only cells matching <experiment>/<cell> (fnmatch, repeatable): 'stress_s/p3o_lr5e-4_*'")
    p.add_argument("--select", action="append", default=[], choices=SELECTIONS,
                   help="a named set of cells: decisive (breaking levels and the level below, the headline and "
                        "remedy cells), headline (P3O vs GRPO at S = 4 and 8, the remedy at T = 1.5), resolved "
                        "(both cells of every pair a section tests whose intervals are apart)")
    p.add_argument("--dry-run", action="store_true", help="no run: how many runs are to make and how long they take")
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
    if not names and not a.cells and not a.select and not a.report_only:
        p.error("name experiments to run ('all' for every one), --cells or --select, or --report-only")
    scale = QUICK if a.quick else FULL
    seeds = a.seeds or list(range(scale.seeds))
    out = (ROOT / (a.out or ("runs/experiments-quick" if a.quick else "runs/experiments"))).resolve()
    results = Path(a.results).resolve() if a.results else (out if a.quick else ROOT / "docs")
    summaries = Path(a.summaries).resolve() if a.summaries else (out / "summaries" if a.quick else SUMMARIES)
    command = "python -m experiments.run " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.report_only:
        print(f"results: {write_report(summaries, results, scale, command)}", flush=True)
        return
    include = [q for sel in a.select for q in selection(sel, summaries, scale)]
    if a.select and not include:          # an empty selection is nothing to make, never every cell
        print(f"--select {' '.join(a.select)}: no cell selected from the summaries in {summaries}: nothing to make",
              flush=True)
        return
    todo = plan(names, include, a.cells, scale, seeds, a.warm_starts)
    if not todo:
        p.error(f"no cell matches --cells {' '.join(a.cells)} (fnmatch on <experiment>/<cell>)")
    if a.dry_run:
        print(estimate(todo, out, summaries, scale, a.jobs), flush=True)
        return
    t0 = time.time()
    threads = max(1, (os.cpu_count() or 1) // a.jobs) if a.jobs > 1 else None
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:    # each warm start's SFT model, once: --jobs at a time
        sfts = dict(zip(a.warm_starts, pool.map(lambda w: prepare_base(warm_root(out, w), scale, threads, w),
                                                a.warm_starts)))
    for warm in a.warm_starts:    # and its own baselines
        w_out, w_sum = warm_root(out, warm), warm_root(summaries, warm)
        for temp in sorted({temperature(c) for w, _, c, _ in todo if w == warm} | {1.0}):
            base_validation(w_out, sfts[warm], scale, w_sum, threads, temp)
            for name in names:    # beside the experiment's runs too: what its section's baseline was (the page's
                kept = base_dir(w_sum, temp)       # summary of this warm start, as stored: the same weights)
                shutil.copytree(kept, base_dir(w_sum / name, temp), dirs_exist_ok=True)
    counts = {"done": 0, "skipped": 0, "failed": 0}

    def one(job):
        warm, name, cell, seed = job
        t1 = time.time()
        status = run_cell(name, cell, seed, sfts[warm], warm_root(out, warm), warm_root(summaries, warm), scale,
                          threads)
        where = f" warm start {warm}" if warm else ""
        print(f"[{name}] {cell.label} seed {seed}{where}: {status} ({time.time() - t1:.0f} s)", flush=True)
        return status

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for status in pool.map(one, todo):
            counts[status] += 1
    page = write_report(summaries, results, scale, command)
    print(f"{counts['done']} run, {counts['skipped']} skipped, {counts['failed']} failed in {time.time() - t0:.0f} s; "
          f"results: {page}", flush=True)
    if counts["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
