"""The long-tailed shape's policy: a Qwen2 of vs_trl's LONG_MODEL size (lit_ess.tiny, random weights,
seed 0; its output head untied: 14.4M parameters) in which one hidden channel carries a constant that
only <|endoftext|>'s logit reads, so the model stops with about the same probability p at every
position whatever it has generated. The lengths it *samples* are then geometric, cut at max_new_tokens:
mean (1 - (1 - p)^M) / p, about a third of M = 128 for p = 0.022, with (1 - p)^(M - 1), about 6%, at the
limit: most completions short, a tail to the limit. Nothing is cut or padded by hand, and the trainer
scores the same weights the engine samples.

How: channel c = 0 of every token embedding is K = 1 (the others are the init's N(0, 0.02)); no layer
writes to it (row c of every o_proj and down_proj is 0), so after the final norm it is K / rms(h), close
to sqrt(hidden_size) since K dominates rms(h); column c of the head is 0 except for <|endoftext|>'s, b,
found by bisection on the model's own hidden states so that the mean stopping probability over positions
of sampled-like sequences is p.

    PYTHONPATH=. .venv/bin/python -m benchmarks.tail_model runs/tail_policy
"""
from __future__ import annotations

import argparse
import json
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


@torch.no_grad()
def build_tail_model(out: Path, max_new: int = 128, mean_len: float | None = None, seed: int = 0) -> dict:
    """Build the model in `out` (mean_len: the wanted mean completion length, default max_new / 3);
    returns its description."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ess.datamodules import Arithmetic
    from lit_ess.datamodules.prompts import encode_prompt
    from lit_ess.tiny import build_tiny_model

    mean_len = mean_len or max_new / 3
    p = stop_probability(mean_len, max_new)
    build_tiny_model(out, seed=seed, **LONG_MODEL)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    emb, c, eos = model.get_input_embeddings().weight, 0, tok.eos_token_id
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(emb.detach().clone())
    emb[:, c] = 1.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[c] = 0.0
        layer.mlp.down_proj.weight[c] = 0.0
    model.lm_head.weight[:, c] = 0.0
    # hidden states of sampled-like sequences: prompts, then random digits to the limit
    g = torch.Generator().manual_seed(seed)
    examples = Arithmetic(digits=2, ops="+", size=10000, seed=0).examples[:16]
    digit_ids = torch.tensor(tok("0123456789", add_special_tokens=False)["input_ids"])
    seqs = [encode_prompt(tok, e.prompt) + digit_ids[torch.randint(10, (max_new,), generator=g)].tolist() for e in examples]
    T = min(map(len, seqs))
    h = model(input_ids=torch.tensor([s[:T] for s in seqs]), output_hidden_states=True).hidden_states[-1]   # [16, T, H]
    base = model.lm_head(h)                                                                           # [16, T, V]
    lo, hi = -10.0, 10.0
    for _ in range(50):                       # p_eos(b) rises with b (channel c is positive)
        b = (lo + hi) / 2
        logits = base.clone()
        logits[..., eos] += b * h[..., c]
        lo, hi = (b, hi) if float(logits.softmax(-1)[..., eos].mean()) < p else (lo, b)
    model.lm_head.weight[eos, c] = b
    model.save_pretrained(out)
    params = sum(t.numel() for t in model.parameters())
    return {"built_by": "benchmarks.tail_model.build_tail_model", **LONG_MODEL, "tie_word_embeddings": False,
            "seed": seed, "parameters": params, "stop_channel": c, "stop_probability": p, "stop_weight": b,
            "designed_mean_len": mean_len, "max_new_tokens": max_new}


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
