"""benchmarks/memory.py on the tiny model: FSDP2 on 2 gloo ranks holds about half the parameter,
gradient and AdamW bytes per rank that one rank holds, and trains the same."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import memory  # noqa: E402


@pytest.mark.dist
def test_fsdp2_halves_state_bytes_per_rank(tiny_model_dir):
    one = {}
    memory._worker(0, 1, 0, tiny_model_dir, 8, 32, 2, 1, one)        # 1 rank, in this process
    two = memory.measure(2, tiny_model_dir, rows=8, tokens=32, steps=2)
    full = one[0]["state_bytes"]
    for rank in two:
        s = rank["state_bytes"]
        assert s["params"] > 0 and s["grads"] > 0 and s["optimizer"] > 0
        assert s["total"] < 0.6 * full["total"], (s, full)
        assert s["params"] < 0.6 * full["params"] and s["optimizer"] < 0.6 * full["optimizer"]
        assert rank["rows"] == 4 and rank["num_params"] == one[0]["num_params"]
        assert rank["losses"] == pytest.approx(one[0]["losses"], rel=1e-4)   # same global batch, same updates
