"""The long-tailed shape's policy: a Qwen2 of vs_trl's LONG_MODEL size (lit_ess.tiny, seed 0; its output
head untied: 14.4M parameters) warm-started by supervised training on answers of long-tailed length, so
that the lengths it *samples* are long-tailed and stay so under RL.

The task: the demo's addition prompts ("37+85="), the answer the sum's digits repeated ("122122122...")
for a length L drawn per example from a geometric law of stopping probability p, cut at max_new_tokens M
(no end-of-text token then: the limit cuts it, as the engine does). L does not depend on the prompt, so
the model can only learn the stopping hazard, p at every position: its sampled lengths are geometric with
mean (1 - (1 - p)^M) / p, about a third of M = 128 for p = 0.022, and (1 - p)^M, about 6%, at the limit.
The hazard is learned by the whole network from data, not one built weight, so the few RL steps of a
benchmark (whose reward, `first_character`, ignores the length) do not move it (measured per step in
vs_trl's JSON: the mean length of each step's completions).

    PYTHONPATH=. .venv/bin/python -m benchmarks.tail_model runs/tail_policy
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

LONG_MODEL = dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=6, intermediate_size=1024)


def stop_probability(mean_len: float, max_new: int) -> float:
    """p with (1 - (1 - p)^M) / p = mean_len: the mean of a geometric length cut at M = max_new."""
    lo, hi = 1e-6, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** max_new) / p > mean_len else (lo, p)
    return (lo + hi) / 2


def tail_targets(answer: str, p: float, max_new: int, rng: random.Random) -> tuple[str, bool]:
    """`answer` repeated to a geometric length L (stopping probability p per token), cut at `max_new`;
    and whether it ends (an end-of-text token follows) before the limit."""
    L = 1
    while L < max_new and rng.random() >= p:
        L += 1
    return (answer * (L // len(answer) + 1))[:L], L < max_new


@torch.no_grad()
def stop_hazard(model, tok, examples, max_new: int) -> float:
    """The model's mean probability of <|endoftext|> at the positions of an answer (the sum repeated to
    max_new tokens, teacher-forced): the per-token stopping probability it learned (the designed one is p)."""
    from lit_ess.datamodules.prompts import encode_prompt

    prompt = [encode_prompt(tok, e.prompt) for e in examples]
    rows = [q + tok((e.answer * max_new)[:max_new], add_special_tokens=False)["input_ids"] for q, e in zip(prompt, examples)]
    T = min(map(len, rows))
    x = torch.tensor([r[:T] for r in rows])                                     # [B, T]
    p_stop = model(input_ids=x).logits.softmax(-1)[..., tok.eos_token_id]       # [B, T]
    return float(p_stop[:, max(map(len, prompt)):].mean())


def build_tail_model(out: Path, max_new: int = 128, mean_len: float | None = None, seed: int = 0,
                     steps: int = 250, batch: int = 32, lr: float = 2e-3) -> dict:
    """Build and warm-start the model in `out` (mean_len: the wanted mean completion length, default
    max_new / 3); returns its description, with the SFT loss and the stopping probability it learned (also
    written to `out`/tail_model.json, which vs_trl reads when given the folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ess.datamodules import Arithmetic
    from lit_ess.datamodules.prompts import encode_prompt
    from lit_ess.tiny import build_tiny_model

    mean_len = mean_len or max_new / 3
    p = stop_probability(mean_len, max_new)
    build_tiny_model(out, seed=seed, **LONG_MODEL)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    examples = Arithmetic(digits=2, ops="+", size=10000, seed=0).examples
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        rows = []
        for ex in rng.sample(examples, batch):
            text, ends = tail_targets(ex.answer, p, max_new, rng)
            prompt = encode_prompt(tok, ex.prompt)
            rows.append((prompt, tok(text, add_special_tokens=False)["input_ids"] + ([eos] if ends else [])))
        T = max(len(a) + len(b) for a, b in rows)
        ids = torch.full((batch, T), pad)                            # [B, T]
        labels = torch.full((batch, T), -100)                        # loss on the answer (and its end) only
        att = torch.zeros(batch, T, dtype=torch.long)
        for r, (a, b) in enumerate(rows):
            ids[r, :len(a) + len(b)] = torch.tensor(a + b)
            labels[r, len(a):len(a) + len(b)] = torch.tensor(b)
            att[r, :len(a) + len(b)] = 1
        for g in opt.param_groups:                                   # 10 steps of warm-up, then constant
            g["lr"] = lr * min(1.0, (step + 1) / 10)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    model.eval()
    h = stop_hazard(model, tok, examples[:32], max_new)
    model.save_pretrained(out)
    params = sum(t.numel() for t in model.parameters())
    info = {"built_by": "benchmarks.tail_model.build_tail_model", **LONG_MODEL, "tie_word_embeddings": False,
            "seed": seed, "parameters": params, "stop_probability": p, "designed_mean_len": mean_len,
            "max_new_tokens": max_new, "sft": {"steps": steps, "batch": batch, "lr": lr,
                                               "seconds": time.perf_counter() - t0,
                                               "loss_first_10": sum(losses[:10]) / 10, "loss_last_10": sum(losses[-10:]) / 10},
            "stop_probability_learned": h, "implied_mean_len": (1 - (1 - h) ** max_new) / h}
    (Path(out) / "tail_model.json").write_text(json.dumps(info, indent=1))
    return info


def length_histogram(lengths: list[int], max_new: int, path: Path, title: str) -> dict:
    """Plot the completion lengths' histogram to `path`; returns their summary."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = torch.tensor(lengths, dtype=torch.float32)
    summary = {"completions": len(lengths), "mean": float(t.mean()), "median": float(t.median()),
               "mean_over_max_new_tokens": float(t.mean()) / max_new, "at_limit_frac": float((t >= max_new).float().mean()),
               "max": int(t.max())}
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(lengths, bins=range(0, max_new + 5, 4), color="tab:blue")
    ax.axvline(summary["mean"], color="k", ls="--", lw=1, label=f"mean {summary['mean']:.1f}")
    ax.set_xlabel(f"completion tokens (max_new_tokens {max_new})")
    ax.set_ylabel("completions")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(build_tail_model(Path(a.out)), indent=1))
