"""The experiment runner end to end (`--quick`): warm start, every experiment, CSVs, plots, results page,
and a second invocation that skips every finished run."""
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cells import EXPERIMENTS, QUICK, apply

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


def test_apply_sets_dotted_keys():
    cfg = {"data": {"init_args": {"sampling": {"temperature": 1.0}}}}
    apply(cfg, {"data.init_args.sampling.temperature": 0.6, "model.init_args.lr": 1e-3})
    assert cfg == {"data": {"init_args": {"sampling": {"temperature": 0.6}}}, "model": {"init_args": {"lr": 1e-3}}}


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
