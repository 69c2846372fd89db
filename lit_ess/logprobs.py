"""Trainer-side log-probabilities of sampled tokens, processed exactly as the rollout engine samples.

Per-token tensors are `[B, L]` and aligned with `input_ids` (prompt + completion, right-padded):
position t holds log pi(input_ids[t] | input_ids[<t]) on completion tokens, 0 everywhere else.

Processing, in the order vLLM applies it:  logits / temperature -> top-k -> top-p -> log-softmax.
top-k keeps every logit >= the k-th largest; top-p sorts ascending, drops the tokens whose cumulative
probability is <= 1 - p and always keeps the most likely one. A sampled token outside the kept set
gets -inf (the truncated policy gives it zero probability).

Chunked scoring (`chunk` tokens at a time). A real vocabulary makes the LM head's output the largest
tensor of the step: [B, L, V] fp32 logits are 1.2 GB for 2 x 1,024 tokens at V = 151,936, and the
processing and the backward keep copies of them. With `chunk` set, the model's LM head is asked for no
logits at all: for the duration of one forward its `forward` is replaced by `head_logprobs`, which takes
the decoder's hidden states of the K positions that predict a completion token and projects them
`chunk` at a time,

    hidden [K, H] --chunk--> head -> logits [c, V] -> process -> (lp [c], entropy [c]) -> cat -> [K]

each chunk but the last under a non-reentrant activation checkpoint, so its [c, V] logits are freed at
once and recomputed in the backward (`ProcessedLogprob` writes the gradient of the processed
log-softmax out by hand, which keeps fewer [c, V] copies than autograd's graph). Peak memory grows with
chunk x V, not with B x L x V; the price is one more head forward for every chunk but the last. The LM head is still
called through the model's own forward, so FSDP2 gathers its weight, LoRA and tied embeddings behave as
in any forward, and a family that post-processes the head's output (e.g. Gemma's logit soft-capping) is
caught by `check_chunked_head` before training. `chunk=None` is the plain path: the model's logits of
the completion span, then `token_logprobs`.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 1024        # tokens per LM-head chunk: 1,024 x 151,936 fp32 logits = 0.62 GB


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
    """log p(targets) under the processed distribution of `logits` ([..., V] -> [...]).

    Returns (logprobs, entropy or None). Uses gather - logsumexp, so no log-softmax of [..., V] is kept.
    """
    x = process_logits(logits, temperature, top_k, top_p)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        p = torch.softmax(x, dim=-1)
        ent = lse - (p * torch.nan_to_num(x, neginf=0.0)).sum(-1)
    return lp, ent


class ProcessedLogprob(torch.autograd.Function):
    """token_logprobs with its gradient written out, so the backward holds ~4 copies of [c, V] (the processed
    logits x, p, one work tensor, the gradient) where autograd's graph of the same ops holds ~8.

    With x = process(logits) / T (-inf where top-k / top-p drop a token), p = softmax(x), lse = logsumexp(x),
    H = lse - sum_j p_j x_j:

        lp = x[y] - lse                   d lp / d x_j = [j = y] - p_j
        H                                 d H  / d x_j = -p_j (x_j - lse + H)
        d / d logits_j = (d / d x_j) / T  on kept tokens; 0 on dropped ones (the masks carry no gradient)
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float,
                with_entropy: bool) -> Tensor:
        x = process_logits(logits, temperature, top_k, top_p)             # [c, V] fp32
        lse = torch.logsumexp(x, dim=-1)                                  # [c]
        lp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ent = lse - (torch.softmax(x, -1) * x.nan_to_num(neginf=0.0)).sum(-1) if with_entropy else None
        ctx.save_for_backward(x, lse, targets, ent if with_entropy else lse)
        ctx.temperature, ctx.with_entropy, ctx.dtype = temperature, with_entropy, logits.dtype
        return torch.stack((lp, ent), -1) if with_entropy else lp.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, lse, targets, ent = ctx.saved_tensors
        g_lp = grad[:, 0:1]                                               # [c, 1]
        p = (x - lse[:, None]).exp_()                                     # [c, V], 0 where dropped
        if ctx.with_entropy:                                              # w = g_lp + g_H (x - lse + H)
            w = (x - lse[:, None] + ent[:, None]).nan_to_num_(neginf=0.0).mul_(grad[:, 1:2]).add_(g_lp)
        else:
            w = g_lp
        d = p.mul_(w).neg_()                                              # -p_j w_j
        kept = x.gather(-1, targets.unsqueeze(-1)).isfinite()              # a dropped target: lp = -inf, no gradient
        d.scatter_add_(-1, targets.unsqueeze(-1), g_lp * kept)            # + [j = y] g_lp
        return d.div_(ctx.temperature).to(ctx.dtype), None, None, None, None, None


def _chunk(head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float,
           with_entropy: bool) -> Tensor:
    """[c, H] hidden states -> [c, 1] logprobs (or [c, 2] with the entropy) through the head's own forward."""
    logits = type(head).forward(head, hidden)                           # [c, V], freed on return
    if torch.is_grad_enabled():
        return ProcessedLogprob.apply(logits, targets, temperature, top_k, top_p, with_entropy)
    lp, ent = token_logprobs(logits, targets, temperature, top_k, top_p, with_entropy)
    return torch.stack((lp, ent), -1) if with_entropy else lp.unsqueeze(-1)


def head_logprobs(head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float = 1.0, top_k: int = -1,
                  top_p: float = 1.0, with_entropy: bool = False, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """Log-probabilities of `targets` ([K]) from `hidden` ([K, H]) through `head`, `chunk` rows at a time:
    [K, 1], or [K, 2] (logprob, entropy).

    With grad enabled every chunk but the last is checkpointed (its logits recomputed in the backward).
    The last chunk keeps its processed logits for the backward instead: the backward runs it first and
    frees them before any other chunk is recomputed, so the peak is the same and one chunk's head
    forward is saved (a micro-batch of at most `chunk` tokens recomputes nothing)."""
    args = (temperature, top_k, top_p, with_entropy)
    starts = range(0, max(len(targets), 1), chunk)         # an empty K still makes one (empty) call: a graph
    out = []
    for s in starts:
        h, t = hidden[s:s + chunk], targets[s:s + chunk]
        if torch.is_grad_enabled() and s != starts[-1]:
            out.append(checkpoint(_chunk, head, h, t, *args, use_reentrant=False))
        else:
            out.append(_chunk(head, h, t, *args))
    return torch.cat(out)


def score_positions(model, inputs: dict, hidden_at: Tensor, targets: Tensor, temperature: float = 1.0,
                    top_k: int = -1, top_p: float = 1.0, with_entropy: bool = False,
                    chunk: int | None = DEFAULT_CHUNK, columns: int | None = None) -> tuple[Tensor, Tensor | None]:
    """(lp [K], entropy [K] or None) of `targets` predicted at the positions `hidden_at` ([K], indices into
    the flattened [R * c] positions the model's forward hands its LM head, c = `columns`, set by
    `logits_to_keep` in `inputs`; a model that ignores `logits_to_keep` is refused, as its c differs).

    chunk=None: the model's logits [R, c, V], then `token_logprobs`. Otherwise the LM head's forward is
    replaced for this one call by `head_logprobs` on the K selected hidden states: the model's `.logits`
    come back as [K, 1 or 2] and no vocabulary-sized tensor outlives a chunk. The first chunked call on a
    model checks once that its forward returns what its head computes (`check_chunked_head`).
    """
    if chunk is None:
        logits = model(**inputs).logits
        _check_columns(model, logits.shape[-2], columns)
        return token_logprobs(logits.reshape(-1, logits.shape[-1])[hidden_at], targets, temperature, top_k, top_p,
                              with_entropy)
    if not getattr(model, "_lit_ess_head_checked", False):
        model._lit_ess_head_checked = True                 # before: the check itself scores chunked
        check_chunked_head(model, chunk)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None): "
                         f"chunked log-probabilities need the LM head; set model.compute.logprob_chunk: null")
    calls = []

    def forward(hidden: Tensor) -> Tensor:               # [R, c, H], what the model hands its LM head
        _check_columns(model, hidden.shape[-2], columns)
        calls.append(1)
        return head_logprobs(head, hidden.reshape(-1, hidden.shape[-1])[hidden_at], targets, temperature, top_k,
                             top_p, with_entropy, chunk)

    own = head.__dict__.get("forward")                   # an instance forward already there (e.g. a hook's)
    head.forward = forward                               # an instance attribute: nn.Module.__call__ finds it first
    try:
        out = model(**inputs).logits                     # [K, 1] or [K, 2]
    finally:
        del head.forward
        if own is not None:
            head.forward = own
    if len(calls) != 1 or out.dim() != 2:
        raise ValueError(f"{type(model).__name__}'s forward does not call its LM head (get_output_embeddings()) once "
                         f"and return its output: chunked log-probabilities cannot score it; set model.compute.logprob_chunk: null")
    return out[:, 0], (out[:, 1] if with_entropy else None)


def _check_columns(model, got: int, want: int | None) -> None:
    if want is not None and got != want:
        raise ValueError(f"{type(model).__name__} ignores logits_to_keep (its LM head got {got} positions a row, not "
                         f"{want}): lit-ess cannot score it")


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                      temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                      with_entropy: bool = False, chunk: int | None = DEFAULT_CHUNK) -> tuple[Tensor, Tensor | None]:
    """Run `model` on `input_ids` ([B, L]) and return per-token logprobs (and entropy), [B, L].

    Only the K completion tokens go through the log-softmax: the model keeps the hidden states from the
    first completion column on (`logits_to_keep`), and token (b, t) is read from position (b, t - 1).
    """
    B, L = input_ids.shape
    at = completion_mask.bool().clone()
    at[:, 0] = False                                     # position 0 has no prediction
    rows, cols = at.nonzero(as_tuple=True)               # [K]
    first = int(cols.min()) if len(cols) else L - 1
    keep = L - first + 1                                 # positions first - 1 .. L - 1
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep)
    lp, ent = score_positions(model, inputs, rows * keep + (cols - first), input_ids[rows, cols], temperature,
                              top_k, top_p, with_entropy, chunk, columns=keep)
    scatter = lambda v: v.new_zeros(B, L).index_put((rows, cols), v)       # noqa: E731
    return scatter(lp), (scatter(ent) if ent is not None else None)


def check_chunked_head(model, chunk: int, where: str = "model_path") -> None:
    """Refuse, in one line, a model whose forward changes its LM head's output before returning it (e.g.
    logit soft-capping, a logit scale): chunked scoring would skip that step. Structural: the plain
    forward's `.logits` must be exactly what the head returned (a forward hook); then chunked and plain
    log-probabilities of a probe row with a prompt must agree. No grad, eval mode. Non-finite logits say
    nothing about the head (a NaN is never equal to itself): the check passes them on to the check of the
    weights, which names the tensor."""
    V = model.config.get_text_config().vocab_size
    ids = torch.arange(8, device=model.device).mul(37).add(5).remainder(V).unsqueeze(0)
    mask, comp = torch.ones_like(ids), torch.arange(8, device=model.device).unsqueeze(0) >= 3
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"model.compute.logprob_chunk={chunk}: {where}'s {type(model).__name__} has no output embeddings "
                         f"(get_output_embeddings() is None); set model.compute.logprob_chunk: null")
    seen = []
    hook = head.register_forward_hook(lambda mod, args, out: seen.append(out))
    training = model.training
    model._lit_ess_head_checked = True
    try:
        with torch.no_grad():                             # eval: a model with dropout gives two draws otherwise
            logits = model.eval()(input_ids=ids, attention_mask=mask, use_cache=False).logits
            hook.remove()
            same = len(seen) == 1 and seen[0].shape == logits.shape and torch.equal(seen[0].to(logits.dtype), logits)
            want, _ = sequence_logprobs(model, ids, mask, comp, chunk=None)
            got, _ = sequence_logprobs(model, ids, mask, comp, chunk=min(chunk, 2))
    finally:
        hook.remove()
        model.train(training)
    if not bool(logits.isfinite().all()):
        return                                            # non-finite weights: the run's own check names them
    diff = float((want - got)[comp].abs().max())
    if not same or not diff <= (1e-3 if logits.dtype == torch.float32 else 5e-2):
        why = "changes its LM head's output before returning logits" if not same else \
            f"gives other log-probabilities chunked (they differ by {diff:.3g})"
        raise ValueError(f"model.compute.logprob_chunk={chunk}: {where}'s {type(model).__name__} {why}; set model.compute.logprob_chunk: null")
