"""benchmarks/run_all.py reads every benchmark's JSON into summary rows, and its markdown; vs_trl.py
without TRL says so instead of comparing anything; the TRL config states the equivalent settings."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import run_all, vs_trl  # noqa: E402


def test_every_listed_benchmark_exists_or_is_optional():
    names = {b.name for b in run_all.BENCHMARKS}
    assert {"objectives", "step", "overhead", "async", "staleness", "ess_floor", "memory", "vs_trl"} <= names
    for b in run_all.BENCHMARKS:
        assert (ROOT / "benchmarks" / f"{b.name}.py").is_file() or b.name == "memory", b.name


@pytest.mark.parametrize("folder", ["", "quick"])
@pytest.mark.parametrize("bench", run_all.BENCHMARKS, ids=lambda b: b.name)
def test_rows_of_the_committed_results(bench, folder):
    path = ROOT / "benchmarks" / "results" / folder / f"{bench.name}.json"
    if not path.is_file():
        pytest.skip(f"no {path.name} in this checkout")
    rows = bench.rows(json.loads(path.read_text()))
    assert rows
    for r in rows:
        assert r["met"] in (True, False, None) and r["goal"] and r["measurement"]
        assert (r["met"] is None) == (r["goal"] == "reported")


def test_markdown_table():
    summary = {"command": "python benchmarks/run_all.py --quick", "quick": True, "finished": "now", "wall_s": 60.0,
               "cpu_count": 2, "torch": "x", "omp_num_threads": "1", "json_dir": "benchmarks/results/quick",
               "rows": [{"benchmark": "objectives", "command": "python benchmarks/objectives.py",
                         **run_all.row("P3O / GRPO", 1.02, "<= 1.10", True)},
                        {"benchmark": "step", "command": "c", **run_all.row("vLLM / hf", 1.5, ">= 5", False, "{:.1f}x")}],
               "benchmarks": {"objectives": {"status": "ok", "wall_s": 10.0},
                              "vs_trl": {"status": "skipped", "reason": "not installed: trl"}}}
    md = run_all.markdown(summary)
    assert "| objectives | P3O / GRPO | 1.020 | <= 1.10 | met | `python benchmarks/objectives.py` |" in md
    assert "| 1.5x | >= 5 | **not met** |" in md
    assert "`vs_trl`: skipped: not installed: trl" in md


def test_vs_trl_without_trl_reports_it(tmp_path, monkeypatch):
    real = vs_trl.importlib.util.find_spec
    monkeypatch.setattr(vs_trl.importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    out = tmp_path / "vs_trl.json"
    vs_trl.main(["--out", str(out)])
    j = json.loads(out.read_text())
    assert j["available"] is False and "not installed" in j["reason"]
    assert run_all._vs_trl(j)[0]["met"] is None


def test_trl_config_is_the_lit_ess_run():
    c = vs_trl.trl_config_kwargs(steps=5, lr=2e-4, seed=0, out_dir="x")
    assert c["per_device_train_batch_size"] // c["num_generations"] == 32 and c["num_generations"] == 8
    assert (c["steps_per_generation"], c["num_iterations"], c["gradient_accumulation_steps"]) == (1, 1, 1)
    assert (c["beta"], c["epsilon"], c["loss_type"], c["max_completion_length"]) == (0.0, 0.2, "dapo", 8)
    assert (c["temperature"], c["top_p"], c["lr_scheduler_type"], c["bf16"]) == (1.0, 1.0, "constant", False)
    grpo = vs_trl.LIT_RUNS["lit-ess GRPO, vLLM"]
    assert grpo[1] == {"clip_eps": c["epsilon"], "aggregation": "token-mean"}
    pytest.importorskip("trl")
    from trl import GRPOConfig

    cfg = GRPOConfig(**{**c, "output_dir": str(Path("/tmp") / "vs_trl_cfg")})
    assert cfg.generation_batch_size == 256 and cfg.steps_per_generation == 1 and not cfg.use_vllm
