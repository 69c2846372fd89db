"""The experiment runner end to end (`--quick`): warm start, every experiment, CSVs, plots, results page,
summaries, the page rebuilt from the summaries alone, and a second invocation that skips every finished
run. The stress experiments' breaking-point table from hand-made summaries."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cells import EXPERIMENTS, FULL, HIGH_LR, LR, METHODS, QUICK, apply, cell_lr
from experiments.report import COLLAPSE, write_report

ROOT = Path(__file__).resolve().parents[1]


def test_apply_sets_dotted_keys():
    cfg = {"data": {"init_args": {"sampling": {"temperature": 1.0}}}}
    apply(cfg, {"data.init_args.sampling.temperature": 0.6, "model.init_args.lr": 1e-3})
    assert cfg == {"data": {"init_args": {"sampling": {"temperature": 0.6}}}, "model": {"init_args": {"lr": 1e-3}}}


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
    (folder / "curves.csv").write_text(f"tag,step,value\nval/pass@1,48,{val}\ntrain/ess,1,0.9\n")
    (folder / "summary.json").write_text(json.dumps({"seconds": 1.0}))


def test_breaking_point_is_the_first_level_where_two_of_three_seeds_collapse(tmp_path):
    base, low = 0.5, 0.5 - COLLAPSE - 0.01
    _summary(tmp_path / "_base" / "val", base)
    for c in EXPERIMENTS["stress_k"].cells:
        if c.method == "p3o" and cell_lr(c) == LR:          # breaks at k = 16: 2 of 3 seeds collapse
            for s, v in enumerate([low, low, 0.7] if c.level == 16 else [0.7, low, 0.7]):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", v)
        if c.method == "grpo_tis" and cell_lr(c) == HIGH_LR:  # collapses at k = 1: the learning rate breaks
            for s in range(3):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", low)
        if c.method == "decoupled" and cell_lr(c) == LR and c.level <= 4:   # stops at k = 4, never breaks
            for s in range(3):
                _summary(tmp_path / "stress_k" / c.label / f"seed{s}", 0.7)
    page = write_report(tmp_path, tmp_path / "out", FULL, "test").read_text()
    rows = {}
    for line in page.splitlines():                  # the first table with a method's row: breaking points
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0][2:], line)
    assert "| k = 16 (2/3) |" in rows["p3o"]
    assert "k = 1 (3/3), on-policy: the learning rate breaks" in rows["grpo_tis"]
    assert "| none up to k = 4 |" in rows["decoupled"]
    assert "## Stress: staleness S" in page and "Not run yet" in page
    assert (tmp_path / "out" / "img" / "experiments" / "stress_k.png").stat().st_size > 10_000


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
        for cell in exp.cells[:QUICK.cells]:
            row = next(line for line in page.splitlines() if line.startswith(f"| {cell.label} |"))
            assert "| 1/1 |" in row, row                                   # its seed finished
            csv = out / name / cell.label / "seed0" / "metrics.csv"
            assert "val/pass@1" in csv.read_text() and "train/ess" in csv.read_text()
    assert "The warm start's held-out pass@1" in page
    # resumable: a second invocation trains nothing
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"0 run, {len(EXPERIMENTS) * QUICK.cells} skipped, 0 failed" in again.stdout, \
        again.stdout[-2000:]
