"""Train on tokens, not padding: micro-batches by a token budget, and padding-free packing.

Rows are the `[B, T]` rows of a step (left-aligned, right-padded; lit_ess.batch). A row's
length is its count of attention-mask tokens.

Planning (pure, deterministic: rows sorted by length, longest first, ties by index):

    plan_micro_batches(lengths, micro_batch_tokens, packed)   first-fit-decreasing bins of rows whose cost
                                                               fits the budget; cost = rows x longest row
                                                               (padded: what a trimmed [b, T_mb] holds) or the
                                                               sum of lengths (packed). A row longer than the
                                                               budget gets a micro-batch of its own.
    plan_ranks(lengths, micro_batch_tokens, world, packed)     rows dealt to ranks longest first, each to the
                                                               rank with the fewest tokens so far (token counts
                                                               within one row's length of each other), then
                                                               each rank's micro-batches, split until every
                                                               rank runs the same number of passes.

Packing: the rows of a micro-batch laid end to end, `[R, W]` with `position_ids` restarting at 0 at
every row start. transformers 5.19 (masking_utils.find_packed_sequence_indices) turns position ids that
restart into a block-diagonal causal mask for sdpa, eager and flex_attention when `attention_mask` is
None and no cache is used (`use_cache=False`: with a cache, the default of most configs, the packed rows
silently attend to each other), and into flash-attention's varlen `cu_seq_lens` on GPU. On CPU,
flex_attention (torch 2.13) has no backward: scoring only.
R = 1 is padding-free; with `width` (e.g. the micro-batch's longest row) rows are first-fit into lines of
at most `width` tokens, so attention costs at most what the padded batch costs (a dense mask over one
[1, N] line costs N^2, more than B T^2 once N > T B^(1/2)) while the MLPs and projections see (almost)
only tokens. The tail of a line is padding with positions 0, 1, ...: a segment of its own, ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .logprobs import DEFAULT_CHUNK, score_positions


# ------------------------------------------------------------------ planning
def _cost(count: int, longest: int, total: int, packed: bool) -> int:
    return total if packed else count * longest


def plan_micro_batches(lengths: list[int], micro_batch_tokens: int, packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch: first-fit-decreasing by length under `micro_batch_tokens`.

    cost(micro-batch) = rows x longest row (padded) or sum of lengths (packed) <= micro_batch_tokens,
    except a single row longer than the budget, which is a micro-batch of its own. Micro-batches come
    longest first; rows inside one are longest first.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        n = lengths[i]
        for k, b in enumerate(bins):                   # first fit; the bin's first row is its longest
            if _cost(len(b) + 1, lengths[b[0]], totals[k] + n, packed) <= micro_batch_tokens:
                b.append(i)
                totals[k] += n
                break
        else:
            bins.append([i])
            totals.append(n)
    return bins


def _split_largest(bins: list[list[int]], lengths: list[int]) -> bool:
    """Split the micro-batch of most tokens that has >= 2 rows into two of alternate rows (keeps both
    longest-first and under the budget); False when every micro-batch has one row."""
    cands = [k for k, b in enumerate(bins) if len(b) > 1]
    if not cands:
        return False
    k = max(cands, key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
    b = bins.pop(k)
    bins[k:k] = [b[0::2], b[1::2]]
    return True


def plan_ranks(lengths: list[int], micro_batch_tokens: int, world: int, packed: bool = False) -> list[list[list[int]]]:
    """Per rank, its micro-batches (indices into `lengths`, the rows of the whole step over all ranks).

        rows       longest first, each to the rank with the fewest tokens so far (ties: lowest rank), so
                   max_r tokens_r - min_r tokens_r <= the longest row
        passes     each rank's plan_micro_batches, then its largest micro-batches split in two until every
                   rank has as many as the rank with most; a rank with fewer rows than that gets empty
                   micro-batches ([]) at the end: a pass with no rows (the caller runs a weight-0 repeat,
                   a collective under FSDP)
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    shares: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += lengths[i]
    plans = []
    for share in shares:
        local = plan_micro_batches([lengths[i] for i in share], micro_batch_tokens, packed)
        plans.append([[share[j] for j in b] for b in local])
    passes = max(len(p) for p in plans)
    for p in plans:
        while len(p) < passes and _split_largest(p, lengths):
            pass
        p += [[] for _ in range(passes - len(p))]
    return plans


# ------------------------------------------------------------------ packing
@dataclass
class Packed:
    """Rows of a [B, T] batch laid end to end in R lines of W tokens.

    input_ids     [R, W] long   the rows' tokens, then padding at the end of a line
    position_ids  [R, W] long   0, 1, ... from every row start (and from a line's padding tail)
    segment_ids   [R, W] long   the [B, T] row of each token; -1 on padding
    flat_index    [n]    long   where the batch's tokens are: position in the flattened [R * W] lines
    batch_index   [n]    long   the same tokens' position in the flattened [B * T] batch
    """
    input_ids: Tensor
    position_ids: Tensor
    segment_ids: Tensor
    flat_index: Tensor
    batch_index: Tensor


def row_lengths(attention_mask: Tensor) -> Tensor:
    """Tokens per row [B] of a left-aligned, right-padded mask [B, T]; ValueError on any other layout."""
    lengths = attention_mask.sum(-1)
    aligned = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None] < lengths[:, None]
    if not torch.equal(attention_mask.bool(), aligned):
        bad = int((attention_mask.bool() != aligned).any(-1).nonzero()[0])
        raise ValueError(f"pack: attention_mask row {bad} is not left-aligned and contiguous (prompt + completion "
                         f"from column 0, padding only at the end)")
    return lengths


def pack(input_ids: Tensor, attention_mask: Tensor, width: int | None = None, pad_id: int = 0) -> Packed:
    """Pack the rows of `input_ids` [B, T] (left-aligned, `attention_mask` [B, T]) into lines.

    width None: one line [1, N], N = the batch's tokens. Else rows are first-fit (longest first) into lines
    of at most max(width, longest row) tokens, [R, W]. Empty rows are left out.
    """
    B, T = input_ids.shape
    lengths = row_lengths(attention_mask).tolist()
    cap = sum(lengths) if width is None else max([width] + lengths)
    lines = plan_micro_batches(lengths, max(cap, 1), packed=True)
    lines = [[b for b in line if lengths[b]] for line in lines]
    lines = [line for line in lines if line] or [[]]
    W = max(sum(lengths[b] for b in line) for line in lines) or 1
    R = len(lines)
    ids = torch.full((R, W), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros(R, W, dtype=torch.long)
    seg = torch.full((R, W), -1, dtype=torch.long)
    flat, batch = [], []
    for r, line in enumerate(lines):
        at = 0
        for b in line:
            n = lengths[b]
            ids[r, at:at + n] = input_ids[b, :n]
            pos[r, at:at + n] = torch.arange(n)
            seg[r, at:at + n] = b
            flat.append(torch.arange(r * W + at, r * W + at + n))
            batch.append(torch.arange(b * T, b * T + n))
            at += n
        pos[r, at:] = torch.arange(W - at)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)      # noqa: E731
    dev = input_ids.device
    return Packed(input_ids=ids.to(dev), position_ids=pos.to(dev), segment_ids=seg.to(dev),
                  flat_index=cat(flat).to(dev), batch_index=cat(batch).to(dev))


def packed_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                    temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, with_entropy: bool = False,
                    width: int | None = None, chunk: int | None = DEFAULT_CHUNK) -> tuple[Tensor, Tensor | None]:
    """Per-token logprobs (and entropy) [B, T] of `model` on the rows packed without padding (`pack`).

    Equal to lit_ess.logprobs.sequence_logprobs on every completion token (the same processing and the
    same chunked LM head, lit_ess.logprobs.score_positions); 0 on every other position. Only the
    positions that predict a completion token reach the LM head (`logits_to_keep`):

        hidden [R, c, H] = model(packed ids, position_ids restarting per row)[positions j - 1]
        lp[b, t] = log p(input_ids[b, t] | input_ids[b, <t])   for the K completion tokens (b, t), t >= 1
    """
    B, T = input_ids.shape
    p = pack(input_ids, attention_mask, width)
    W = p.input_ids.shape[1]
    comp = completion_mask.reshape(-1)[p.batch_index]                  # [n] which packed tokens are completion
    first = p.position_ids.reshape(-1)[p.flat_index] == 0              # a row's first token has no prediction
    keep = comp & ~first
    target_at = p.flat_index[keep]                                      # [K] in the flattened lines
    cols = torch.unique(target_at % W - 1)                              # [c] columns that predict a target
    inputs = dict(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False,
                  logits_to_keep=cols)
    hidden_at = (target_at // W) * len(cols) + torch.searchsorted(cols, target_at % W - 1)      # [K] in [R * c]
    lp, ent = score_positions(model, inputs, hidden_at, p.input_ids.reshape(-1)[target_at], temperature, top_k,
                              top_p, with_entropy, chunk, columns=len(cols))
    dest = p.batch_index[keep]
    out = lp.new_zeros(B * T).index_put((dest,), lp).view(B, T)
    if ent is not None:
        ent = ent.new_zeros(B * T).index_put((dest,), ent).view(B, T)
    return out, ent


def check_packed_forward(model, where: str = "model_path") -> None:
    """Refuse, in one line, a model whose packed forward lets a row attend to the rows before it in its line:
    transformers builds the block-diagonal mask from restarting position ids only in the families whose
    mask builder receives them (OPT, Bloom and MPT build theirs without), and a run on leaky rows looks
    healthy (ESS 0.9997 on-policy). Three probe rows, two of which share a line, are scored packed and
    padded once, in eval mode, without grad."""
    from .logprobs import sequence_logprobs

    V = model.config.get_text_config().vocab_size
    lengths = (6, 3, 3)                                    # rows 2 and 3 share a line of width 6
    ids = (torch.arange(18, device=model.device).view(3, 6) * 7 + 5).remainder(V)
    mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long().to(model.device)
    comp = mask.bool()
    training = model.training
    try:
        with torch.no_grad():
            padded, _ = sequence_logprobs(model.eval(), ids, mask, comp, chunk=None)
            packed, _ = packed_logprobs(model, ids, mask, comp, chunk=None)
    finally:
        model.train(training)
    diff = float((padded - packed)[comp].abs().max())
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2
    if not diff <= tol:
        raise ValueError(f"model.micro_batch.packing=true: {where}'s {type(model).__name__} does not keep packed rows apart (its "
                         f"packed and padded log-probabilities differ by {diff:.3g}: its attention mask ignores "
                         f"position_ids); set model.micro_batch.packing: false")

