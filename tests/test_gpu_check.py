"""scripts/gpu_check.sh --cpu: the GPU check's own code at a tiny shape on this CPU, so the script works the
first time it meets a GPU."""
import json
import os
import subprocess


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(out)], capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["failed"] == [] and got["mode"] == "cpu dry run"
    for name in ("train_1k_chunked", "train_1k_unchunked", "train_4k_chunked", "train_4k_unchunked", "fsdp2_1k", "lora_1k"):
        assert got[name]["tokens_per_s"] > 0, name
    for n in ("1k", "4k"):        # the same step, chunked or not
        assert abs(got[f"train_{n}_chunked"]["loss"] - got[f"train_{n}_unchunked"]["loss"]) < 1e-5
    assert [round(s["ess"], 4) for s in got["ess_sync"]["steps"]] == [1.0, 1.0, 1.0]     # fp32 engine and trainer


def test_gpu_check_large_dry_run(tmp_path):
    """--large (Qwen2.5-7B's shape on a GPU): full fine-tuning and LoRA with activation checkpointing."""
    out = tmp_path / "gpu_check_7b.json"
    res = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--large", "--out", str(out)], capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["failed"] == []
    for n in ("4k", "16k"):
        assert abs(got[f"full_{n}_chunked"]["loss"] - got[f"full_{n}_unchunked"]["loss"]) < 1e-5
    assert got["lora_4k_chunked"]["tokens_per_s"] > 0
