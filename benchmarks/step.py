"""Two throughput ratios, each measured within this one run.

1. One PolicyModule optimizer step inside a Lightning Trainer against a plain PyTorch loop doing the
   same work (same model, same batch, same objective, clipping, AdamW). Goal: <= 1.10x the time.
2. vLLM against transformers `generate` (the hf engine), generated tokens/s, on the 1.8M-parameter
   tiny model and on a 25M-parameter one (width 512, 8 layers). Goal: vLLM >= 5x. On 2 CPU cores
   the ratio grows with the model (vLLM's per-step overhead dominates the tiny one): see docs/benchmarks.md.

    .venv/bin/python benchmarks/step.py [--steps 30 --rounds 3] [--out benchmarks/results/step.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lit_ess.engines import HFConfig, VLLMConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.logprobs import sequence_logprobs
from lit_ess.module import PolicyModule
from lit_ess.objectives import P3O
from lit_ess.batch import RolloutBatch
from lit_ess.tiny import build_tiny_model
from lit_ess.settings import Optim


def make_batch(vocab: int, B=64, P=8, T=56, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, P + T), generator=g)
    comp = torch.zeros(B, P + T, dtype=torch.bool)
    comp[:, P:] = True
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=comp,
                        behavior_logprobs=torch.where(comp, -torch.rand(B, P + T, generator=g) * 5, 0.0),
                        advantages=torch.randn(B, generator=g), rewards=torch.zeros(B),
                        versions=torch.zeros(B, dtype=torch.long), prompt_ids=torch.arange(B),
                        prompt_texts=[""] * B, completion_texts=[""] * B,
                        sampling=SamplingConfig(max_new_tokens=64),
                        stats={"rollout/reward_mean": 0.0}, max_staleness=10**9)   # the same batch every step


class _Same(Dataset):
    def __init__(self, batch, n):
        self.batch, self.n = batch, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.batch


class _Timer(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, *a):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *a):
        self.times.append(time.perf_counter() - self.t0)


def lightning_steps(model_dir, batch, steps):
    module = PolicyModule(model_dir, optim=Optim(lr=1e-5))
    timer = _Timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(module, DataLoader(_Same(batch, steps), batch_size=None))
    return timer.times


def plain_steps(model_dir, batch, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    objective = P3O()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        out = objective(lp, batch.behavior_logprobs, batch.advantages, batch.completion_mask)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def generation(model_dir, prompts=64, n=8, new_tokens=128):
    s = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    ps = [[1] + list(range(20, 26)) for _ in range(prompts)]
    out = {}
    for name, config in (("vllm", VLLMConfig()), ("hf", HFConfig())):
        engine = config.build(model_dir)
        engine.generate(ps[:4], 2, s)                        # warm-up (vLLM compiles on its first call)
        t0 = time.perf_counter()
        groups = engine.generate(ps, n, s)
        dt = time.perf_counter() - t0
        out[name] = sum(len(c.token_ids) for g in groups for c in g) / dt
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/step.json")
    a = p.parse_args(argv)
    result = {"command": "python benchmarks/step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "steps": a.steps, "rounds": a.rounds, "torch_threads": torch.get_num_threads(),
              "goal_lightning_ratio_max": 1.10, "goal_vllm_ratio_min": 5.0, "generation": {}}
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(build_tiny_model(d + "/m"))
        batch = make_batch(260)
        tokens = int(batch.completion_mask.sum())
        lit, plain = [], []
        for _ in range(a.rounds):            # alternate, so slow phases of the machine hit both alike
            lit += lightning_steps(model_dir, batch, a.steps)[3:]
            plain += plain_steps(model_dir, batch, a.steps)[3:]
        ml, mp = statistics.median(lit), statistics.median(plain)
        print(f"optimizer step on [64, 64] ({tokens} completion tokens), median of {len(lit)} steps "
              f"({a.rounds} alternating rounds, 3 warm-up steps dropped from each):")
        print(f"  PolicyModule in Lightning: {ml * 1e3:8.1f} ms  {tokens / ml:10.0f} tok/s")
        print(f"  plain PyTorch loop:        {mp * 1e3:8.1f} ms  {tokens / mp:10.0f} tok/s")
        print(f"  time ratio Lightning / plain: {ml / mp:.3f}  (goal <= 1.10)")
        result["step"] = {"lightning_s": ml, "plain_s": mp, "ratio": ml / mp, "tokens": tokens, "steps_timed": len(lit)}
        small_dir = str(build_tiny_model(d + "/small", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                                         intermediate_size=1536))
        for label, path, prompts in [("tiny 1.8M", model_dir, 64), ("small 25M", small_dir, 16)]:
            gen = generation(path, prompts=prompts)
            print(f"generation, {label}, {prompts} prompts x 8 samples x up to 128 new tokens (seeded): "
                  f"vllm {gen['vllm']:.0f} tok/s, hf {gen['hf']:.0f} tok/s, "
                  f"ratio {gen['vllm'] / gen['hf']:.1f}x  (goal >= 5x)")
            result["generation"][label] = {"prompts": prompts, "samples": 8, "max_new_tokens": 128,
                                           "vllm_tok_s": gen["vllm"], "hf_tok_s": gen["hf"],
                                           "ratio": gen["vllm"] / gen["hf"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
