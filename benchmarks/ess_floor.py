"""The ESS floor of each behaviour/target mismatch, measured at lag 0.

Lag 0: the engine holds exactly the trainer's weights (no update between sampling and scoring), so
any ESS below 1 comes from the mismatch alone: engine precision, sampling temperature against the
trainer's, top-p, and which logprobs are recorded as pi_b (`processed`: the distribution sampled
from; `raw`: untempered and untruncated, as the authors' code records). For each setting it samples
`--phases` rollouts of the demo task (32 prompts x 8 samples) with vLLM and reports the step ESS
e_B = (sum rho)^2 / (n sum rho^2) over each rollout's tokens, as the trainer computes it.

    .venv/bin/python benchmarks/ess_floor.py [--model runs/demo/sft/model] [--phases 4] [--out benchmarks/results/ess_floor.json]

Each setting runs in its own process (one vLLM engine each).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

SETTINGS = {   # name: (engine dtype, behavior_logprobs, sampling temperature, top_p, train_temperature)
    "reference (fp32, T 1.0)": ("float32", "processed", 1.0, 1.0, None),
    "bf16 engine": ("bfloat16", "processed", 1.0, 1.0, None),
    "sample T 0.6, train T 1.0": ("float32", "processed", 0.6, 1.0, 1.0),
    "sample T 1.2, train T 1.0": ("float32", "processed", 1.2, 1.0, 1.0),
    "sample T 1.5, train T 1.0": ("float32", "processed", 1.5, 1.0, 1.0),
    "top-p 0.9 (trainer replays it)": ("float32", "processed", 1.0, 0.9, None),
    "top-p 0.9, raw logprobs": ("float32", "raw", 1.0, 0.9, None),
    "sample T 0.6, raw logprobs": ("float32", "raw", 0.6, 1.0, None),
    "sample T 1.2, raw logprobs": ("float32", "raw", 1.2, 1.0, None),
}


def measure(model: str, name: str, phases: int) -> dict:
    from transformers import AutoModelForCausalLM

    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.engines import VLLMConfig
    from lit_ess.sampling import SamplingConfig
    from lit_ess.logprobs import sequence_logprobs
    from lit_ess.objectives import ess_stats

    dtype, logprobs, T, top_p, train_T = SETTINGS[name]
    dm = RolloutDataModule(model_path=model, engine=VLLMConfig(dtype=dtype, behavior_logprobs=logprobs),
                           sampling=SamplingConfig(temperature=T, top_p=top_p, max_new_tokens=8, seed=0),
                           source=Arithmetic(digits=2, ops="+", size=10000, seed=0), reward="exact_match")
    dm.setup("fit")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ess, ratio_max, tokens = [], 0.0, 0
    with torch.no_grad():
        for _ in range(phases):
            b = dm.generate_phase()[0]
            lp, _ = sequence_logprobs(policy, b.input_ids, b.attention_mask, b.completion_mask,
                                      train_T or T, b.sampling.top_k, b.sampling.top_p)
            mask = b.completion_mask & torch.isfinite(lp) & torch.isfinite(b.behavior_logprobs)
            ess.append(float(ess_stats(lp - b.behavior_logprobs, mask).value()))
            ratio_max = max(ratio_max, float((lp - b.behavior_logprobs)[mask].exp().max()))
            tokens += int(mask.sum())
    dm.teardown("fit")
    return {"setting": name, "engine_dtype": dtype, "behavior_logprobs": logprobs, "sampling_temperature": T,
            "top_p": top_p, "train_temperature": train_T or T, "ess_mean": sum(ess) / len(ess), "ess_min": min(ess),
            "ratio_max": ratio_max, "tokens": tokens, "phases": phases}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/demo/sft/model", help="policy folder (default: the demo's SFT model)")
    p.add_argument("--phases", type=int, default=4, help="rollouts of 32 prompts x 8 samples per setting")
    p.add_argument("--out", default="benchmarks/results/ess_floor.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.model, a.one, a.phases)))
        return
    if not Path(a.model).is_dir():
        sys.exit(f"ess_floor: no model folder {a.model}: run `bash scripts/demo.sh` first, or pass --model")
    rows = []
    for name in SETTINGS:
        out = subprocess.run([sys.executable, __file__, "--model", a.model, "--phases", str(a.phases), "--one", name],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"ess_floor: setting {name!r} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{name:34s} ESS mean {r['ess_mean']:.4f}  min {r['ess_min']:.4f}  ratio max {r['ratio_max']:.3f}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "command": "python benchmarks/ess_floor.py " + " ".join(argv or sys.argv[1:]),
                                       "rows": rows}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
