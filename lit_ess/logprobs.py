"""Trainer-side log-probabilities of sampled tokens, processed exactly as the rollout engine samples.

Per-token tensors are `[B, L]` and aligned with `input_ids` (prompt + completion, right-padded):
position t holds log pi(input_ids[t] | input_ids[<t]); position 0 has no prediction and is 0.

Processing, in the order vLLM applies it:  logits / temperature -> top-k -> top-p -> log-softmax.
top-k keeps every logit >= the k-th largest; top-p sorts ascending, drops the tokens whose cumulative
probability is <= 1 - p and always keeps the most likely one. A sampled token outside the kept set
gets -inf (the truncated policy gives it zero probability).
"""
from __future__ import annotations

import torch
from torch import Tensor


def process_logits(logits: Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """Apply temperature, top-k and top-p to `logits` ([..., V]) in float32; masked entries are -inf."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling with logprobs, got {temperature}")
    x = logits.float() / temperature
    if top_k is not None and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return x


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = -1,
                   top_p: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log p(targets) under the processed distribution of `logits` ([B, T, V] -> [B, T]).

    Returns (logprobs, entropy or None). Uses gather - logsumexp, so no [B, T, V] log-softmax is kept.
    """
    x = process_logits(logits, temperature, top_k, top_p)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        p = torch.softmax(x, dim=-1)
        ent = lse - (p * torch.nan_to_num(x, neginf=0.0)).sum(-1)
    return lp, ent


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                      temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                      with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Run `model` on `input_ids` ([B, L]) and return per-token logprobs (and entropy), [B, L].

    Only positions from the first completion token on are projected through the log-softmax, so long
    prompts cost a forward pass but no vocabulary-sized work.
    """
    B, L = input_ids.shape
    cols = completion_mask.any(0).nonzero()
    start = max(int(cols[0]) if len(cols) else L - 1, 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    lp, ent = token_logprobs(logits[:, start - 1:L - 1], input_ids[:, start:], temperature, top_k, top_p, with_entropy)
    out = lp.new_zeros(B, L)
    out[:, start:] = lp
    if ent is not None:
        full = ent.new_zeros(B, L)
        full[:, start:] = ent
        ent = full
    return out, ent
