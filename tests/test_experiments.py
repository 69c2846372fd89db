"""The experiment runner end to end (`--quick`): warm start, every experiment, CSVs, plots, results page,
summaries, the page rebuilt from the summaries alone, and a second invocation that skips every finished
run. The stress experiments' breaking-point table from hand-made summaries; the multi-turn experiment's
configs read by the real CLI parser, without running."""
import json
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from experiments.cells import (EXPERIMENTS, FULL, HIGH_LR, K_LEVELS, LR, METHODS, MULTITURN_ENV, QUICK, S, apply,
                               cell_lr)
from experiments.report import COLLAPSE, write_report

ROOT = Path(__file__).resolve().parents[1]


def test_apply_sets_dotted_keys():
    cfg = {"data": {"init_args": {"sampling": {"temperature": 1.0}}}}
    apply(cfg, {"data.init_args.sampling.temperature": 0.6, "model.init_args.lr": 1e-3})
    assert cfg == {"data": {"init_args": {"sampling": {"temperature": 0.6}}}, "model": {"init_args": {"lr": 1e-3}}}


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


def _summary(folder: Path, val: float) -> None:
    folder.mkdir(parents=True)
    (folder / "curves.csv").write_text(f"step,train/ess,val/pass@1\n1,0.9,\n48,,{val}\n")
    (folder / "summary.json").write_text(json.dumps({"seconds": 1.0}))


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
    assert demo["model"]["init_args"]["model_path"] == sft["trainer"]["callbacks"][0]["init_args"]["dirpath"]
    assert FULL.sft_steps == sft["trainer"]["max_steps"]
    for c in exp.cells:
        cfg = cell_config("multiturn", c, 2, tmp_path / "sft", tmp_path / c.label, FULL)
        data = cfg["data"]["init_args"]
        assert cfg["model"]["init_args"]["objective"] == METHODS[c.method]["model.init_args.objective"]
        assert data["env"] == MULTITURN_ENV and data["env"] is not MULTITURN_ENV and data[S.split(".")[-1]] == c.level
        assert "mode" not in data and data.get("steps_per_rollout", 1) == 1          # sync, one step per rollout
        assert cfg["model"]["init_args"]["model_path"] == str(tmp_path / "sft") and cfg["seed_everything"] == 2
        assert data["reward"] == "exact_match" and data["val_sampling"] == {"temperature": 1.0}
        assert (cfg["trainer"]["max_steps"], cfg["trainer"]["check_val_every_n_epoch"], data["prompts_per_rollout"],
                data["samples_per_prompt"]) == (32, 8, 8, FULL.samples)             # sized down (exp.size)
        quick = cell_config("multiturn", c, 0, tmp_path / "sft", tmp_path / c.label, QUICK)
        assert (quick["trainer"]["max_steps"], quick["data"]["init_args"]["prompts_per_rollout"]) == \
            (QUICK.steps, QUICK.prompts)                                              # a cap: --quick stays quick


def test_multiturn_configs_build(tiny_model_dir, tmp_path):
    """Each method's multi-turn config at the highest S is one `lit-ess fit --config` accepts: parsed and
    built (the environment config, the objective with its correction, the staleness bound), not run."""
    from lit_ess.cli import LitESSCLI, _Parser
    from lit_ess.envs import EnvConfig
    from experiments.run import cell_config

    for c in [c for c in EXPERIMENTS["multiturn"].cells if c.level == 8]:
        f = tmp_path / f"{c.label}.yaml"
        f.write_text(yaml.safe_dump(cell_config("multiturn", c, 0, Path(tiny_model_dir), tmp_path / c.label, FULL)))
        with mock.patch.object(sys, "argv", ["lit-ess"]):
            cli = LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                            args=["--config", str(f)], auto_configure_optimizers=False, run=False)
        dm, objective = cli.datamodule, cli.model.objective
        assert dm.env == EnvConfig(**MULTITURN_ENV) and dm.max_staleness == c.level and dm.mode == "sync"
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
    assert "| p3o | S = 8 (3/3) |" in section and "| grpo_tis | none up to S = 8 |" in section
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
    assert f"| k = {top} (2/3) |" in rows["p3o"]
    assert "k = 1 (3/3), on-policy: the learning rate breaks" in rows["grpo_tis"]
    assert f"| none up to k = 1, k = {top} incomplete (0/3 seeds) |" in rows["decoupled"]
    assert "| k = 1 incomplete (1/3 seeds) |" in rows["p3o_no_kl"]      # not k = 48: k = 1 may break first
    assert "## Stress: staleness S" in page and "Not run yet" in page
    assert (tmp_path / "out" / "img" / "experiments" / "stress_k.png").stat().st_size > 10_000


def _tables(page: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith("|")]


@pytest.mark.e2e
def test_quick_suite_makes_the_plots_and_the_results_page(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, "-m", "experiments.run", "all", "--quick", "--out", str(out), "--results", str(results)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    page = (results / "results.md").read_text()
    for name, exp in EXPERIMENTS.items():
        png = results / "img" / "experiments" / f"{name}.png"
        assert png.exists() and png.stat().st_size > 10_000, png          # a real plot, not an empty canvas
        assert f"## {exp.title}" in page
        section = page.split(f"## {exp.title}\n")[1].split("\n## ")[0].splitlines()
        for cell in exp.cells[:QUICK.cells]:
            if exp.axis:                                                   # stress: a row per method
                row = next(line for line in section if line.startswith(f"| {cell.method} |"))
                assert "none up to" in row or "(1/1)" in row, row          # its seed finished
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
    assert again.returncode == 0 and f"0 run, {len(EXPERIMENTS) * QUICK.cells} skipped, 0 failed" in again.stdout, \
        again.stdout[-2000:]
