"""The experiment runner end to end (`--quick`): warm start, a plain, a stress and the multi-turn experiment
trained, CSVs, plots, results page, summaries, the page rebuilt from the summaries alone, and a second
invocation that skips every finished run; the other experiments' quick cells built by the real CLI, not
run. The stress experiments' breaking-point table from hand-made summaries; the multi-turn experiment's
configs read by the real CLI parser, without running."""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.cells import (EXPERIMENTS, FULL, HIGH_LR, K, K_LEVELS, LR, METHODS, MULTITURN_ENV, QUICK, S, apply,
                               cell_lr)
from experiments import report
from experiments.report import COLLAPSE, write_report

ROOT = Path(__file__).resolve().parents[1]


def test_apply_sets_dotted_keys():
    cfg = {"data": {"init_args": {"sampling": {"temperature": 1.0}}}}
    apply(cfg, {"data.init_args.sampling.temperature": 0.6, "model.init_args.optim.lr": 1e-3})
    assert cfg == {"data": {"init_args": {"sampling": {"temperature": 0.6}}}, "model": {"init_args": {"optim": {"lr": 1e-3}}}}


def test_a_runs_config_shares_no_list_with_its_cell(tmp_path):
    """The temperature cells add ExportHF to their callbacks; a list shared between cells would make every
    later run export its weights into those cells' folders."""
    from experiments.run import cell_config

    cells = [c for c in EXPERIMENTS["temperature"].cells if c.label.endswith("_anchor")]
    cfgs = [cell_config("temperature", c, 0, tmp_path, tmp_path / c.label, FULL) for c in cells]
    decoupled = next(c for c in EXPERIMENTS["stress_k"].cells if c.method == "decoupled")
    later = cell_config("stress_k", decoupled, 0, tmp_path, tmp_path / "d", FULL)
    assert [cb["class_path"].rsplit(".", 1)[1] for cb in later["trainer"]["callbacks"]] == ["WeightSync"]
    for c, cfg in zip(cells, cfgs):
        exports = [cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("ExportHF")]
        assert [e["init_args"]["dirpath"] for e in exports] == [str(tmp_path / c.label / "final")]


def test_stress_cells_cover_every_method_rate_and_level():
    for name, letter in (("stress_k", "k"), ("stress_s", "S")):
        cells = EXPERIMENTS[name].cells
        assert {(c.method, cell_lr(c)) for c in cells} == {(m, lr) for m in METHODS for lr in (LR, HIGH_LR)}
        levels = sorted({c.level for c in cells})
        assert len(cells) == len(METHODS) * 2 * len(levels) and len({c.label for c in cells}) == len(cells)
    on_policy = [c for c in EXPERIMENTS["stress_s"].cells if c.level == 0]
    assert all(c.same_as == f"stress_k/{c.label}" and c.label.endswith("_k1") for c in on_policy)


def _summary(folder: Path, val: float, **summary) -> None:
    folder.mkdir(parents=True)
    (folder / "curves.csv").write_text(f"step,train/ess,val/pass@1\n1,0.9,\n48,,{val}\n")
    (folder / "summary.json").write_text(json.dumps({"seconds": 1.0, **summary}))


def test_multiturn_cells_are_the_demos_task_at_three_staleness_levels(tmp_path):
    """3 methods (P3O and the stress experiments' GRPO eps 0.2 and GRPO + token TIS) x S = 0, 4, 8: the
    episodes of configs/demo_multiturn.yaml from its warm start (the demo's supervised one, which is the
    runner's `_base/sft`), staleness made as in stress_s (sync, generated ahead), validation single-turn."""
    from experiments.run import cell_config

    exp = EXPERIMENTS["multiturn"]
    assert {(c.method, c.level) for c in exp.cells} == {(m, s) for m in ("p3o", "grpo_eps0.2", "grpo_tis")
                                                         for s in (0, 4, 8)}
    assert len(exp.cells) * FULL.seeds == 27 and len({c.label for c in exp.cells}) == 9 and exp.axis
    demo = yaml.safe_load((ROOT / "configs" / "demo_multiturn.yaml").read_text())
    assert MULTITURN_ENV == demo["data"]["init_args"]["env"]
    sft = yaml.safe_load((ROOT / "configs" / "demo_sft.yaml").read_text())      # what prepare_base runs
    assert demo["model"]["init_args"]["model_path"] == f"{sft['output_dir']}/model"          # ExportHF's folder
    assert FULL.sft_steps == sft["trainer"]["max_steps"]
    for c in exp.cells:
        cfg = cell_config("multiturn", c, 2, tmp_path / "sft", tmp_path / c.label, FULL)
        data = cfg["data"]["init_args"]
        assert cfg["model"]["init_args"]["objective"] == METHODS[c.method]["model.init_args.objective"]
        assert data["env"] == MULTITURN_ENV and data["env"] is not MULTITURN_ENV and data["schedule"]["max_staleness"] == c.level
        assert "schedule" not in data or "mode" not in data["schedule"]
        assert data["batch"].get("steps_per_rollout", 1) == 1          # sync, one step per rollout
        assert cfg["model"]["init_args"]["model_path"] == str(tmp_path / "sft") and cfg["seed_everything"] == 2
        assert data["reward"] == "exact_match" and data["validation"]["sampling"] == {"temperature": 1.0}
        assert (cfg["trainer"]["max_steps"], cfg["trainer"]["check_val_every_n_epoch"], data["batch"]["prompts_per_rollout"],
                data["batch"]["samples_per_prompt"]) == (32, 8, 8, FULL.samples)             # sized down (exp.size)
        quick = cell_config("multiturn", c, 0, tmp_path / "sft", tmp_path / c.label, QUICK)
        assert (quick["trainer"]["max_steps"], quick["data"]["init_args"]["batch"]["prompts_per_rollout"]) == \
            (QUICK.steps, QUICK.prompts)                                              # a cap: --quick stays quick


def _build(cfg: dict, path: Path):
    """The run's config as `lit-ess fit --config` reads it: written, parsed and built (model, data module,
    trainer), not run."""
    from lit_ess.cli import LitESSCLI, _Parser

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with mock.patch.object(sys, "argv", ["lit-ess"]):
        return LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                         args=["--config", str(path)], auto_configure_optimizers=False, run=False)


def test_multiturn_configs_build(tiny_model_dir, tmp_path):
    """Each method's multi-turn config at the highest S is one `lit-ess fit --config` accepts: parsed and
    built (the environment config, the objective with its correction, the staleness bound), not run."""
    from experiments.run import cell_config

    for c in [c for c in EXPERIMENTS["multiturn"].cells if c.level == 8]:
        cli = _build(cell_config("multiturn", c, 0, Path(tiny_model_dir), tmp_path / c.label, FULL),
                     tmp_path / f"{c.label}.yaml")
        dm, objective = cli.datamodule, cli.model.objective
        assert dm.env.hparams() == {"env": {"class_path": "lit_ess.envs.arithmetic.RetryArithmetic",
                                            "init_args": MULTITURN_ENV["env"]["init_args"]},
                                    "max_turns": 3, "max_episode_tokens": 96, "step_timeout": 10.0}
        assert dm.schedule.max_staleness == c.level and dm.schedule.mode == "sync"
        assert type(objective).__name__ == ("P3O" if c.method == "p3o" else "GRPO")
        tis = objective.correction
        assert (tis.level, tis.mode, tis.high) == ("token", "truncate", 2.0) if c.method == "grpo_tis" else tis is None
        if c.method != "p3o":
            assert objective.clip_eps == 0.2


def test_multiturn_page_tables_turns_and_reward_per_staleness(tmp_path):
    """A stress experiment whose runs played episodes adds the training reward, the turns per episode and
    the mean ESS (mean +- std over seeds, per method and level) and their panels to the plot. Its runs
    started from a warm start of their own (`multiturn/_base/`): its collapse line is that one's."""
    _summary(tmp_path / "_base" / "val", 0.5)
    _summary(tmp_path / "multiturn" / "_base" / "val", 0.63)
    for c in EXPERIMENTS["multiturn"].cells:
        final = 0.51 if c.label == "p3o_S8" else 0.6    # collapsed against 0.63 - 0.1, not against 0.5 - 0.1
        for s in range(3):                        # turns 1.2 + s / 10 for every cell: mean 1.3, std 0.1
            d = tmp_path / "multiturn" / c.label / f"seed{s}"
            d.mkdir(parents=True)
            (d / "curves.csv").write_text("step,rollout/reward_mean,rollout/turns,train/ess,val/pass@1\n"
                                          f"1,0.5,2.0,0.5,\n2,0.8,{1.2 + s / 10},1.0,{final}\n")
            (d / "summary.json").write_text(json.dumps({"seconds": 1.0}))
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    section = page.split("## Multi-turn")[1]
    assert "another warm start" in section and "**0.630**" in section and "another warm start" not in \
        page.split("## Multi-turn")[0]
    assert "| p3o | S = 8 (3/3 [0.44, 1.00]) |" in section and "| grpo_tis | none up to S = 8 (0/3 [0.00, 0.56] there) |" in section
    turns = section.split("Policy turns per episode, last 10% of steps, lr 2e-4")[1].splitlines()
    assert "| p3o | 1.300 +- 0.100 | 1.300 +- 0.100 | 1.300 +- 0.100 |" in turns
    ess = section.split("Mean ESS e_B, lr 2e-4")[1].splitlines()
    assert "| grpo_tis | 0.750 +- 0.000 | 0.750 +- 0.000 | 0.750 +- 0.000 |" in ess
    assert "| method | S = 0 | S = 4 | S = 8 |" in section and "none up to S = 8" in section
    assert "8 prompts x 8 samples per rollout, 32 optimizer steps, held out every 8 steps" in section
    assert "Policy turns per episode" not in page.split("## Multi-turn")[0]     # single-turn sections unchanged
    assert (tmp_path / "out" / "img" / "experiments" / "multiturn.png").stat().st_size > 10_000


def test_breaking_point_is_the_first_level_where_two_of_three_seeds_collapse(tmp_path):
    base, low = 0.5, 0.5 - COLLAPSE - 0.01
    top = K_LEVELS[-1]
    _summary(tmp_path / "_base" / "val", base)
    for c in EXPERIMENTS["stress_k"].cells:
        if c.method == "p3o" and cell_lr(c) == LR:          # breaks at the top level: 2 of 3 seeds collapse
            for s, v in enumerate([low, low, 0.7] if c.level == top else [0.7, low, 0.7]):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", v)
        if c.method == "grpo_tis" and cell_lr(c) == HIGH_LR:  # collapses at k = 1: the learning rate breaks
            for s in range(3):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", low)
        if c.method == "decoupled" and cell_lr(c) == LR and c.level == 1:   # only k = 1 run, no collapse
            for s in range(3):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", 0.7)
        if c.method == "p3o_no_kl" and cell_lr(c) == LR:     # k = 1: one seed (collapsed), two missing
            for s, v in enumerate([low] if c.level == 1 else [low, low, 0.7]):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", v)
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    rows = {}
    for line in page.splitlines():                  # the first table with a method's row: breaking points
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0][2:], line)
    assert f"| k = {top} (2/3 [0.21, 0.94]) |" in rows["p3o"]
    assert "k = 1 (3/3 [0.44, 1.00]), on-policy: the learning rate breaks" in rows["grpo_tis"]
    assert f"| none up to k = 1, k = {top} incomplete (0/3 seeds) |" in rows["decoupled"]
    assert "| k = 1 incomplete (1/3 seeds) |" in rows["p3o_no_kl"]      # not k = 48: k = 1 may break first
    assert "## Stress: staleness S" in page and "Not run yet" in page
    assert (tmp_path / "out" / "img" / "experiments" / "stress_k.png").stat().st_size > 10_000


def _tables(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith("|")]


# What the pipeline test trains, each a fresh `lit-ess fit` (most of a quick run's time is its start): a plain
# experiment (temperature, with its second ruler at the run's own temperature), a stress axis (stress_s,
# generated ahead) and the multi-turn one. The others' quick cells are built by the CLI, not run
# (test_quick_cells_not_trained_end_to_end_build); their sections say "Not run yet".
TRAINED = ("temperature", "stress_s", "multiturn")


def test_quick_cells_not_trained_end_to_end_build(tiny_model_dir, tmp_path):
    """Every other experiment's quick cell, as the runner writes it, is a config `lit-ess fit` accepts: built
    with the cell's objective, its data and engine overrides and the quick run's length."""
    from experiments.run import cell_config

    for name, exp in EXPERIMENTS.items():
        for cell in exp.cells[:QUICK.cells] if name not in TRAINED else []:
            cfg = cell_config(name, cell, 0, Path(tiny_model_dir), tmp_path / name, QUICK)
            cli = _build(cfg, tmp_path / f"{name}.yaml")
            obj = cfg["model"]["init_args"]["objective"]
            assert type(cli.model.objective).__name__ == obj["class_path"].rsplit(".", 1)[1], name
            assert all(getattr(cli.model.objective, k) == v for k, v in obj.get("init_args", {}).items()), name
            assert cli.model.optim.lr == cell_lr(cell) and cli.trainer.max_steps == QUICK.steps, name
            dm = cli.datamodule
            k = int(cell.overrides.get(K, 1)) if exp.batch_per_step else 1      # stress_k: rows per step kept
            assert (dm.batch.prompts_per_rollout, dm.batch.samples_per_prompt) == (QUICK.prompts * k, QUICK.samples), name
            for key, value in {**exp.common, **cell.overrides}.items():     # k, S, mode, engine dtype, ...
                *where, field = key.removeprefix("data.init_args.").split(".")
                if key == "data.init_args.engine.class_path":                 # the engine's class (inflight)
                    assert f"{type(dm.engine_config).__module__.rsplit('.', 1)[0]}.{type(dm.engine_config).__name__}" \
                        == value, (name, key)
                elif key.startswith("data."):
                    target = {(): dm, ("engine", "init_args"): dm.engine_config, ("sampling",): dm.sampling,
                              ("batch",): dm.batch, ("schedule",): dm.schedule}[tuple(where)]
                    got = getattr(target, field)
                    if isinstance(value, dict) and hasattr(got, "__dataclass_fields__"):   # env: EnvConfig, by its
                        got = got.hparams()                                                # plain values
                        value = {**value, "env": {"class_path": "lit_ess.envs.arithmetic.RetryArithmetic",
                                                  "init_args": value["env"]["init_args"]}}
                        got = {k: got[k] for k in value}
                    assert got == value, (name, key)


@pytest.mark.e2e
def test_quick_suite_makes_the_plots_and_the_results_page(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, "-m", "experiments.run", *TRAINED, "--quick", "--out", str(out), "--results", str(results)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    page = (results / "results.md").read_text()
    for name, exp in EXPERIMENTS.items():
        assert f"## {exp.title}" in page
        section = page.split(f"## {exp.title}\n")[1].split("\n## ")[0].splitlines()
        if name not in TRAINED:
            assert "Not run yet (no summaries)." in section, name
            continue
        png = results / "img" / "experiments" / f"{name}.png"
        assert png.exists() and png.stat().st_size > 10_000, png          # a real plot, not an empty canvas
        for cell in exp.cells[:QUICK.cells]:
            if exp.axis:                                                   # stress: a row per method
                row = next(line for line in section if line.startswith(f"| {cell.method} |"))
                assert "none up to" in row or "(1/1 [" in row, row          # its seed finished
            else:
                row = next(line for line in section if line.startswith(f"| {cell.label} |"))
                assert "| 1/1 |" in row, row                               # its seed finished
            csv = out / name / cell.label / "seed0" / "metrics.csv"
            assert "val/pass@1" in csv.read_text() and "train/ess" in csv.read_text()
            kept = out / "summaries" / name / cell.label / "seed0"
            assert "val/pass@1" in (kept / "curves.csv").read_text()
            assert json.loads((kept / "summary.json").read_text())["final"]["val/pass@1"] >= 0
    assert "The warm start's held-out pass@1" in page and "Breaking point" in page
    own = json.loads((out / "summaries" / "temperature" / EXPERIMENTS["temperature"].cells[0].label / "seed0" /
                      "summary.json").read_text())["own_temperature"]
    assert own["temperature"] == 0.6 and 0 <= own["val/pass@1"] <= 1        # the second, own-temperature ruler
    # the same page from a copy of the summaries alone
    shutil.copytree(out / "summaries", tmp_path / "kept")
    only = subprocess.run([sys.executable, "-m", "experiments.run", "--report-only", "--quick", "--summaries",
                           str(tmp_path / "kept"), "--results", str(tmp_path / "again")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert only.returncode == 0, only.stdout[-2000:] + only.stderr[-2000:]
    assert _tables((tmp_path / "again" / "results.md").read_text()) == _tables(page)
    # resumable: a second invocation trains nothing
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"0 run, {len(TRAINED) * QUICK.cells} skipped, 0 failed" in again.stdout, \
        again.stdout[-2000:]


# --- intervals (hand-computed) -------------------------------------------------------------------------

def test_wilson_interval_known_values():
    """z = 1.96, z^2 = 3.8415. 0/3: center = half-width = (z^2/2) / (3 + z^2) = 1.9207 / 6.8415 = 0.2807, so
    [0, 0.5615]; 3/3 mirrors it, [0.4385, 1]. 5/10: center 0.5, half = 1.96 / 13.8415 * sqrt(2.5 + 0.9604)
    = 0.1416 * 1.8602 = 0.2634, so [0.2366, 0.7634]."""
    from experiments.intervals import wilson

    for (k, n), (lo, hi) in {(0, 3): (0.0, 0.5615), (3, 3): (0.4385, 1.0), (5, 10): (0.2366, 0.7634)}.items():
        assert wilson(k, n) == pytest.approx((lo, hi), abs=1e-4)
    with pytest.raises(ValueError, match="k <= n"):
        wilson(4, 3)


def test_bootstrap_interval_known_values():
    """Resample means of [0, 1]: 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 95% bounds are 0 and 1, the
    central 40% (a = 0.3) is 0.5 alone. Four 0s and four 1s: the mean is Binomial(8, 1/2) / 8; P(<= 1/8) =
    9/256 = 0.035 is the first cumulative >= 0.025, P(<= 6/8) = 247/256 = 0.965 < 0.975: [0.125, 0.875]."""
    from experiments.intervals import bootstrap_mean

    assert bootstrap_mean([0.0, 1.0]) == (0.0, 1.0)
    assert bootstrap_mean([0.0, 1.0], level=0.4) == (0.5, 0.5)
    assert bootstrap_mean([0.0] * 4 + [1.0] * 4) == (0.125, 0.875)
    assert bootstrap_mean([0.3, 0.3, 0.3]) == (0.3, 0.3)
    xs = [0.61, 0.55, 0.72, 0.66, 0.58, 0.7, 0.64, 0.59]
    assert bootstrap_mean(xs) == bootstrap_mean(xs)                    # a fixed RNG seed: the page is reproducible
    with pytest.raises(ValueError, match="no values"):
        bootstrap_mean([])


@given(st.lists(st.floats(0, 1), min_size=3, max_size=3))
@settings(max_examples=30, deadline=None)
def test_bootstrap_interval_of_three_seeds_is_their_range(xs):
    """With 3 values an all-min (or all-max) resample has probability 1/27 > 2.5%: the bounds are min and max."""
    from experiments.intervals import bootstrap_mean

    lo, hi = bootstrap_mean(xs)
    assert lo == pytest.approx(min(xs)) and hi == pytest.approx(max(xs))


def test_apart_needs_the_intervals_not_to_overlap():
    from experiments.intervals import apart

    assert apart((0.6, 0.7), (0.4, 0.59)) == 1 and apart((0.4, 0.59), (0.6, 0.7)) == -1
    assert apart((0.4, 0.6), (0.6, 0.7)) == 0 and apart((0.0, 1.0), (0.4, 0.5)) == 0


# --- the runner's axes: seeds, warm starts, cell selections (no training) ------------------------------

def test_seeds_take_a_count_ranges_and_lists(capsys):
    from experiments.run import main, parse_seeds

    assert parse_seeds("8") == list(range(8)) and parse_seeds("0-7") == list(range(8))
    assert parse_seeds("0,3,5-7") == [0, 3, 5, 6, 7] and parse_seeds("5-5") == [5] and parse_seeds("2,1-3") == [2, 1, 3]
    for bad in ("3-1", "a", "1-", "-2", "0", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seeds(bad)
    with pytest.raises(SystemExit):
        main(["clip", "--seeds", "3-1", "--dry-run"])
    assert "--seeds" in capsys.readouterr().err


def test_plan_names_patterns_seeds_and_warm_starts():
    from experiments.run import plan

    assert len(plan(["clip"], [], [], FULL, [0, 1, 2], [0])) == 5 * 3
    only = plan(["clip"], [], ["clip/p3o"], FULL, [3, 4], [0])
    assert [(w, n, c.label, s) for w, n, c, s in only] == [(0, "clip", "p3o", 3), (0, "clip", "p3o", 4)]
    # a pattern alone; stress_s's S = 0 cell is stress_k's run, planned once
    jobs = plan([], ["stress_s/p3o_lr5e-4_*"], [], FULL, [3], [0, 1])
    assert sorted((w, c.label) for w, _, c, _ in jobs) == sorted(
        (w, f"p3o_lr5e-4_{lv}") for w in (0, 1) for lv in ("S4", "S8", "S24", "k1"))
    both = plan(["stress_k", "stress_s"], [], [], FULL, [0], [0])
    assert len(both) == len(EXPERIMENTS["stress_k"].cells) + sum(c.same_as is None for c in EXPERIMENTS["stress_s"].cells)
    assert plan([], ["nothing/*"], [], FULL, [0], [0]) == []


def test_warm_start_zero_keeps_the_layout_and_the_config(tmp_path):
    """Warm start 0's runs and summaries stay where they were (the stored summaries stay valid); a run's
    config depends on its cell, seed and warm start only, not on how the seeds were asked for."""
    from experiments.run import cell_config, config_digest, warm_root

    assert warm_root(tmp_path, 0) == tmp_path and warm_root(tmp_path, 2) == tmp_path / "warm2"
    cell = EXPERIMENTS["clip"].cells[0]
    cfg = cell_config("clip", cell, 5, tmp_path / "_base" / "sft", tmp_path / "clip" / cell.label / "seed5", FULL)
    assert cfg["seed_everything"] == 5 and cfg["model"]["init_args"]["model_path"] == str(tmp_path / "_base" / "sft")
    assert config_digest("clip", cell, 5, FULL) == config_digest("clip", cell, 5, FULL) != config_digest("clip", cell, 6, FULL)


def test_a_summary_made_elsewhere_with_the_same_config_is_reused(tmp_path):
    from experiments.run import config_digest, made

    cell = EXPERIMENTS["clip"].cells[0]
    d, dest = tmp_path / "runs" / "seed0", tmp_path / "summaries" / "seed0"
    digest = config_digest("clip", cell, 0, FULL)
    dest.mkdir(parents=True)
    (dest / "summary.json").write_text(json.dumps({"seconds": 1.0, "config_sha256": digest}))
    assert made(d, dest, "cfg", digest)
    assert not made(d, dest, "cfg", config_digest("clip", cell, 1, FULL))     # another config: run it
    (dest / "summary.json").write_text(json.dumps({"seconds": 1.0}))            # no digest: not known to match
    assert not made(d, dest, "cfg", digest)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("cfg")
    (d / "done.json").write_text("{}")
    assert made(d, dest, "cfg", digest) and not made(d, dest, "other", digest)


def test_a_summary_names_its_runs_seed_scheme_and_a_run_made_before_reads_per_sample(tmp_path):
    """summary.json records how the run's samples were seeded (`seed_scheme`, written beside the wall time
    in done.json when it finished); a run finished before the field was drawn per sample. The digest stays
    the config's, so a stored summary without the field is still the run made."""
    from experiments.run import config_digest, made, summarize_run

    from lit_ess.sampling import SEED_SCHEME

    cell = EXPERIMENTS["clip"].cells[0]
    digest = config_digest("clip", cell, 0, FULL)
    for done, want in (({"seconds": 2.0, "seed_scheme": SEED_SCHEME}, "per-group"), ({"seconds": 2.0}, "per-sample")):
        d, dest = tmp_path / want / "run", tmp_path / want / "summary"
        d.mkdir(parents=True)
        (d / "done.json").write_text(json.dumps(done))
        (d / "metrics.csv").write_text("tag,step,value\nval/pass@1,4,0.5\n")
        summarize_run(d, dest, cell, digest)
        summary = json.loads((dest / "summary.json").read_text())
        assert summary["seed_scheme"] == want and summary["config_sha256"] == digest
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps({"seconds": 1.0, "config_sha256": digest}))     # stored before
    assert made(tmp_path / "no-run", old, "cfg", digest)


def test_page_says_which_seed_scheme_each_cells_runs_used(tmp_path):
    """Stored runs without the field are per-sample; an experiment whose cells differ names them per cell,
    a cell with both says how many of each."""
    _summary(tmp_path / "_base" / "val", 0.5)
    for s in range(3):
        _summary(tmp_path / "clip" / "p3o" / f"seed{s}", 0.6)                                  # before the field
        _summary(tmp_path / "clip" / "grpo_eps0.2" / f"seed{s}", 0.6, seed_scheme="per-group")
        _summary(tmp_path / "clip" / "dapo" / f"seed{s}", 0.6, **({"seed_scheme": "per-group"} if s else {}))
        _summary(tmp_path / "ablations" / "p3o" / f"seed{s}", 0.6)
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    clip, ablations = (next(x for x in page.split("\n## ") if x.startswith(EXPERIMENTS[e].title))
                       for e in ("clip", "ablations"))
    assert "**per-group**: `grpo_eps0.2`; **mixed (2 per-group, 1 per-sample of 3)**: `dapo`; **per-sample**: `p3o`." \
        in clip
    assert "Sampling seeds: every stored run **per-sample** (one vLLM request per sample" in ablations


def test_runs_are_not_added_to_summaries_of_another_warm_start(tmp_path):
    from experiments.run import base_validation

    d = tmp_path / "runs" / "_base" / "val"
    d.mkdir(parents=True)
    (d / "metrics.csv").write_text("tag,step,value\nval/pass@1,0,0.635\n")
    _summary(tmp_path / "summaries" / "_base" / "val", 0.574)
    (tmp_path / "summaries" / "_base" / "val" / "summary.json").write_text(json.dumps({"final": {"val/pass@1": 0.574}}))
    with pytest.raises(SystemExit, match="not the one"):
        base_validation(tmp_path / "runs", tmp_path / "sft", FULL, tmp_path / "summaries")
    (tmp_path / "summaries" / "_base" / "val" / "summary.json").write_text(json.dumps({"final": {"val/pass@1": 0.635}}))
    base_validation(tmp_path / "runs", tmp_path / "sft", FULL, tmp_path / "summaries")       # the same one: fine

    # a summary that names its warm start's weights is judged by them, not by a pass@1 that another seeding of the
    # evaluation's samples moves (the rebuilt warm start is the stored one bit for bit): kept as it was stored
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"weights")
    from experiments.run import weights_sha256

    stored = {"weights_sha256": weights_sha256(tmp_path / "sft"), "final": {"val/pass@1": 0.574}}
    (tmp_path / "summaries" / "_base" / "val" / "summary.json").write_text(json.dumps(stored))
    base_validation(tmp_path / "runs", tmp_path / "sft", FULL, tmp_path / "summaries")       # 0.635 here: fine
    assert json.loads((tmp_path / "summaries" / "_base" / "val" / "summary.json").read_text()) == stored
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(SystemExit, match="not the one"):
        base_validation(tmp_path / "runs", tmp_path / "sft", FULL, tmp_path / "summaries")


def test_selections_name_existing_cells_and_decisive_follows_the_breaks(tmp_path):
    """decisive: on each stress line's learning rate, every method at each level where one breaks and the
    level below, a line that breaks nowhere at the top level; plus the headline and remedy cells."""
    from experiments.run import HEADLINE, REMEDY, plan, selection

    for pattern in HEADLINE + [REMEDY]:
        assert plan([], [pattern], [], FULL, [0], [0]), pattern
    base, low = 0.5, 0.5 - COLLAPSE - 0.01
    _summary(tmp_path / "_base" / "val", base)
    for c in EXPERIMENTS["stress_s"].cells:
        if c.method == "p3o" and cell_lr(c) == HIGH_LR:   # breaks at S = 8 (S = 0 is stress_k's k = 1 run)
            for s, v in enumerate([low, low, low] if c.level in (8, 24) else [0.7, 0.7, 0.7]):
                _summary(tmp_path / (c.same_as or f"stress_s/{c.label}") / f"seed{s}", v)
    chosen = plan([], selection("decisive", tmp_path, FULL), [], FULL, [0], [0])
    stress_s = {(cell_lr(c), c.level, c.method) for _, n, c, _ in chosen if n == "stress_s"}
    assert stress_s == ({(HIGH_LR, lv, m) for lv in (4, 8) for m in METHODS} | {(LR, 24, m) for m in METHODS}
                        | {(HIGH_LR, 24, m) for m in METHODS if m != "p3o"})          # lines that break nowhere
    assert {c.level for _, n, c, _ in chosen if n == "stress_k"} == {K_LEVELS[-1]}       # nothing broke there
    assert {c.label for _, n, c, _ in chosen if n == "temperature"} == {
        f"p3o_T{t}_processed_k4{a}" for t in (0.6, 1.2, 1.5) for a in ("", "_anchor")}


def test_resolved_selects_both_cells_of_every_difference_the_page_calls(tmp_path):
    """resolved: a pair whose means' (or collapse counts') intervals are apart, both cells; not a pair
    whose intervals overlap, nor a cell without a partner."""
    from experiments.run import plan, selection

    _summary(tmp_path / "_base" / "val", 0.5)
    for s, (hi, lo, near) in enumerate([(0.80, 0.30, 0.79), (0.81, 0.31, 0.70), (0.82, 0.32, 0.81)]):
        _summary(tmp_path / "clip" / "p3o" / f"seed{s}", hi)
        _summary(tmp_path / "clip" / "grpo_eps0.2" / f"seed{s}", lo)        # apart from p3o
        _summary(tmp_path / "clip" / "grpo_eps0.4" / f"seed{s}", near)      # overlaps p3o
    assert selection("resolved", tmp_path, FULL) == ["clip/p3o", "clip/grpo_eps0.2"]
    chosen = plan([], selection("resolved", tmp_path, FULL), [], FULL, list(range(8)), [0])
    assert {(n, c.label) for _, n, c, _ in chosen} == {("clip", "p3o"), ("clip", "grpo_eps0.2")} and len(chosen) == 16


def test_an_empty_selection_makes_nothing(tmp_path, capsys):
    """No difference resolved: `--select resolved` makes nothing (an empty include must not mean every cell)."""
    from experiments.run import main

    _summary(tmp_path / "_base" / "val", 0.5)
    for s, (a, b) in enumerate([(0.70, 0.69), (0.72, 0.73), (0.71, 0.70)]):
        _summary(tmp_path / "clip" / "p3o" / f"seed{s}", a)
        _summary(tmp_path / "clip" / "grpo_eps0.2" / f"seed{s}", b)
    main(["--select", "resolved", "--seeds", "0-7", "--summaries", str(tmp_path), "--out", str(tmp_path / "runs"),
          "--dry-run"])
    out = capsys.readouterr().out
    assert "no cell selected" in out and "nothing to make" in out and "runs planned" not in out


def test_claims_verdict_agrees_with_every_baselines_interval():
    """The claims row tests P3O against every baseline, not only the highest mean: above the highest but
    overlapping a wide lower one is 'above some'; below a narrow lower one is 'below some' even when the
    highest mean's wide interval overlaps P3O's."""
    from experiments.report import CellStats, claims

    def row(p3o, eps02, eps04):
        stats = {("clip", c): CellStats(v, 0, 3) for c, v in (("p3o", p3o), ("grpo_eps0.2", eps02),
                                                                ("grpo_eps0.4", eps04))}
        return next(line for line in claims(stats, FULL) if line.startswith("| clip/`p3o` |"))

    a = row([0.80, 0.81, 0.82], [0.70, 0.705, 0.71], [0.20, 0.85, 0.30])
    assert "| `grpo_eps0.2` 0.705 [0.700, 0.710] (3) | **above some, below none** (above `grpo_eps0.2`) |" in a
    b = row([0.50, 0.52, 0.54], [0.68, 0.69, 0.70], [0.40, 0.95, 0.90])
    assert "`grpo_eps0.4`" in b and "**below some** (below `grpo_eps0.2`) |" in b
    assert "**above every baseline** |" in row([0.90, 0.91, 0.92], [0.50, 0.51, 0.52], [0.60, 0.61, 0.62])
    assert "**not resolved against any** |" in row([0.60, 0.70, 0.80], [0.65, 0.70, 0.75], [0.62, 0.66, 0.70])


# --- the page's intervals and sentences ---------------------------------------------------------------

def test_page_reads_every_seed_and_states_intervals_and_resolved_differences(tmp_path):
    _summary(tmp_path / "_base" / "val", 0.5)
    anchor, paper = ((tmp_path / "temperature" / f"p3o_T1.5_processed_k4{a}") for a in ("_anchor", ""))
    own = {"own_temperature": {"temperature": 1.5, "val/pass@1": 0.3}}
    for s in range(8):                                  # 8 seeds apart: resolved; 3 seeds of grpo in clip
        _summary(anchor / f"seed{s}", 0.70 + 0.01 * s, **own)
        _summary(paper / f"seed{s}", 0.20 + 0.01 * s, **own)
    for s in range(3):
        _summary(tmp_path / "clip" / "p3o" / f"seed{s}", 0.6 + 0.01 * s)
        _summary(tmp_path / "clip" / "grpo_eps0.2" / f"seed{s}", 0.61 + 0.01 * s)
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| p3o_T1.5_processed_k4_anchor |"))
    assert "| 8/8 | 0.735 [" in row and "| 0/8 [0.00, 0.32] |" in row
    assert "`p3o_T1.5_processed_k4_anchor` above `p3o_T1.5_processed_k4` (0.735 vs 0.235)" in page
    assert "| 0.610 [0.600, 0.620] |" in next(line for line in page.splitlines() if line.startswith("| p3o | 3/3"))
    assert "**Not resolved** (the means' intervals overlap): `p3o` vs `grpo_eps0.2`" in page
    claims = page.split("## What this evidence says about the paper's claims")[1]
    assert "T = 1.5: 0.735 vs 0.235, resolved above" in claims and "not resolved against any in 1 (of 1 settings)" in claims
    assert "| clip/`p3o` | 0.610 [0.600, 0.620] (3) | `grpo_eps0.2` 0.620 [0.610, 0.630] (3) | **not resolved against any** |" \
        in claims
    assert "## Warm starts" not in page
    # a second warm start: its own section, each difference per warm start
    _summary(tmp_path / "warm1" / "_base" / "val", 0.6)
    for s in range(3):
        _summary(tmp_path / "warm1" / "temperature" / "p3o_T1.5_processed_k4_anchor" / f"seed{s}", 0.7, **own)
        _summary(tmp_path / "warm1" / "temperature" / "p3o_T1.5_processed_k4" / f"seed{s}", 0.69 + 0.01 * s, **own)
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    warm = page.split("## Warm starts")[1]
    assert "warm start 1 (from 0.600)" in warm
    assert ("warm start 0 above, warm start 1 not resolved: depends on the warm start" in warm)
    claim = page.split("## What this evidence says about the paper's claims")[1]
    assert ("**Does a conclusion depend on the starting policy?** From 2 warm starts (held-out pass@1 0.500, "
            "0.600; section above), the same from every one: none; depends on the warm start: "
            "`p3o_T1.5_processed_k4_anchor` vs `p3o_T1.5_processed_k4` (above, not resolved).") in claim


def test_trace_reading_says_the_tables_numbers_for_p3o_against_grpo():
    """Steps 1-8: steps 2-6 early, the last quarter (7-8) late; every number in the sentence is read from the runs."""
    exp = EXPERIMENTS["mechanism_stress"]
    def run(grad, lo, kl=None, capped=None):
        r = {"train/ess": [(t, 1.0) for t in range(1, 9)],
             "train/grad_norm": [(t, grad[0] if t <= 6 else grad[1]) for t in range(1, 9)],
             "train/grad_share_rho_lo": [(t, lo[0] if t <= 6 else lo[1]) for t in range(1, 9)]}
        if kl:
            r["train/kl_grad_share"] = [(t, kl[0] if t <= 6 else kl[1]) for t in range(1, 9)]
            r["train/capped_frac"] = [(t, capped) for t in range(1, 9)]
        return r
    runs = {"p3o_S8": [run((8, 30), (0.2, 0.4), (0.1, 0.5), 0.8), run((12, 50), (0.2, 0.6), (0.3, 0.5), 0.8)],
            "grpo_eps0.2_S8": [run((2, 5), (0.01, 0.02))]}
    text = "\n".join(report.trace_reading(exp, runs))
    assert ("S = 8 (2 and 1 seeds): P3O's gradient norm is 5.0x GRPO's in steps 2-6 (10 vs 2) and 8.0x in the "
            "last quarter (40 vs 5); the share of its |dL/dlp| on tokens with rho < 1/2 goes from 20% to 50% "
            "(GRPO: 1% to 2%), the (1 - e_B) KL term's share from 20% to 50%; 80% of P3O's tokens") in text
    assert "S = 24" not in text                                 # no runs there: nothing said
    assert report.trace_reading(exp, {}) == []


def test_remedy_table_tests_each_remedy_against_p3o_and_grpo_from_every_warm_start(tmp_path):
    """Issue 39's table: a row per (setting, warm start, remedy), the remedy's interval against P3O's and GRPO
    (eps 0.2)'s in the same setting (their runs stored where the page's stress cells are), and per remedy how
    often it is resolved below GRPO: here above P3O and GRPO from warm start 0, below GRPO from warm start 1."""
    from experiments.report import remedy_table

    def cell(root, path, vals):
        for s, v in enumerate(vals):
            _summary(root / path / f"seed{s}", v)

    for root, remedy, p3o, grpo in ((tmp_path, 0.64, 0.21, 0.50), (tmp_path / "warm1", 0.40, 0.30, 0.60)):
        _summary(root / "_base" / "val", 0.57)
        cell(root, "remedies_s/p3o_k3_sampled_capped_lr5e-4_S8", [remedy + 0.001 * s for s in range(8)])
        cell(root, "stress_s/p3o_lr5e-4_S8", [p3o + 0.001 * s for s in range(8)])
        cell(root, "stress_s/grpo_eps0.2_lr5e-4_S8", [grpo + 0.001 * s for s in range(8)])
    lines = remedy_table(tmp_path, FULL)
    rows = [line for line in lines if line.startswith("| remedies_s/`lr5e-4_S8` |")]
    assert len(rows) == 2
    assert rows[0].startswith("| remedies_s/`lr5e-4_S8` | 0 | `p3o_k3_sampled_capped` | 0.643 [0.642, 0.645]; 0/8 ")
    assert rows[0].endswith("| **above** | **above** |  |") and "| 0.213 [0.212, 0.215]; 8/8 [0.68, 1.00] | 0.504 [" in rows[0]
    assert rows[1].startswith("| remedies_s/`lr5e-4_S8` | 1 |") and rows[1].endswith("| **above** | **below** |  |")
    assert ("- `p3o_k3_sampled_capped` against GRPO (eps 0.2), in 2 rows (setting x warm start): resolved above in 1, "
            "resolved below in 1, not resolved in 0.") in lines
    assert remedy_table(tmp_path / "nothing", FULL) == []
    # a verdict needs FULL.seeds finished seeds on both sides: two seeds of the remedy are too few
    shutil.rmtree(tmp_path / "warm1")
    for s in range(2, 8):
        shutil.rmtree(tmp_path / "remedies_s" / "p3o_k3_sampled_capped_lr5e-4_S8" / f"seed{s}")
    row = next(line for line in remedy_table(tmp_path, FULL) if line.startswith("| remedies_s/`lr5e-4_S8` |"))
    assert row.endswith("| too few seeds | too few seeds |  |")


def test_every_same_as_cell_is_its_references_config():
    """A cell `same_as` another is run and stored once, there: its own config must be that one, or the page
    would show a run of another config under its name."""
    from experiments.run import canonical, cell_config

    for scale in (FULL, QUICK):
        for name, exp in EXPERIMENTS.items():
            for cell in exp.cells:
                if cell.same_as:
                    ref_name, ref = canonical(name, cell)
                    args = (Path("<warm start>"), Path("<run>"), scale)
                    assert cell_config(name, cell, 0, *args) == cell_config(ref_name, ref, 0, *args), \
                        f"{name}/{cell.label} is not {cell.same_as}"
