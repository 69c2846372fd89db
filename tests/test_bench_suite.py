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
    assert {"objectives", "step", "overhead", "async", "staleness", "ess_floor", "memory", "vs_trl",
            "vs_trl_long", "gen_settings", "lora"} <= names
    for b in run_all.BENCHMARKS:
        assert (ROOT / "benchmarks" / b.file).is_file() or b.name == "memory", b.name


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


def test_trl_config_of_the_long_shape():
    sh = vs_trl.SHAPES["long"]
    c = vs_trl.trl_config_kwargs(5, 2e-4, 0, "x", sh["prompts"], sh["samples"], sh["new_tokens"])
    assert (c["per_device_train_batch_size"], c["num_generations"], c["max_completion_length"]) == (128, 8, 64)


def test_phase_split_adds_up_to_the_step():
    """Each interval between step ends is split into the logged phases and the rest; the first WARMUP
    steps are dropped; the floor is training + generation."""
    n = vs_trl.WARMUP + 3
    ends = [float(i) * 2.0 for i in range(n)]                     # 2 s per step
    ph = {"generation": 0.5, "scoring": 0.1, "training": 1.0, "weight_sync": 0.2}
    r = vs_trl.summarise([{"step_ends": ends, "cpu_ends": [e / 2 for e in ends], "rewards": [0.0] * n,
                           "phases": [dict(ph)] * n}])
    assert r["steps_timed"] == n - vs_trl.WARMUP - 1
    assert r["phases_mean_s"]["rest"] == pytest.approx(0.2) and r["floor_s"] == pytest.approx(1.5)
    assert sum(r["phases_mean_s"].values()) == pytest.approx(r["s_per_step_mean"]) == pytest.approx(2.0)
    assert r["cpu_s_per_step_median"] == pytest.approx(1.0)


def test_summary_rows_of_a_phase_split():
    base = {"reward_first": 0.1, "reward_last": 0.2, "s_per_step_median": 2.0, "step_over_floor": 1.05,
            "phases_mean_s": {"generation": 1.0, "training": 0.9}}
    j = {"available": True, "shape": "long", "batch": {"prompts": 16, "samples": 8, "new_tokens": 64},
         "goal_vs_trl": 0.8, "goal_vs_floor": 1.1, "trl_version": "1.16.0",
         "runs": {"TRL GRPOTrainer, transformers generate": base,
                  "lit-ess GRPO, vLLM": {**base, "time_vs_trl": 0.75, "phases_vs_trl": {"generation": 0.6}}}}
    rows = run_all._vs_trl(j)
    assert [r["met"] for r in rows] == [None, True, None, True]
    assert "16 x 8 x 64" in rows[1]["measurement"] and rows[1]["goal"] == "<= 0.8"


def test_tail_targets_are_the_answer_repeated_to_a_geometric_length():
    import random

    from benchmarks.tail_model import stop_probability, tail_targets

    p = stop_probability(128 / 3, 128)
    assert (1 - (1 - p) ** 128) / p == pytest.approx(128 / 3, rel=1e-6)      # a third of 128, cut at 128
    rng = random.Random(0)
    drawn = [tail_targets("122", p, 128, rng) for _ in range(4000)]
    assert all(t == ("122" * 43)[:len(t)] for t, _ in drawn)
    assert all(ends == (len(t) < 128) and 1 <= len(t) <= 128 for t, ends in drawn)
    lengths = [len(t) for t, _ in drawn]
    assert sum(lengths) / len(lengths) == pytest.approx(128 / 3, rel=0.05)
    assert sum(n == 128 for n in lengths) / len(lengths) == pytest.approx((1 - p) ** 127, abs=0.015)
