"""RolloutBatch: the rows of one optimizer step, as the trainer consumes them.

Tensors are `[B, T]` over prompt + completion tokens, left-aligned and right-padded, unless noted:

    input_ids          [B, T] long    prompt tokens, then completion tokens, then padding
    attention_mask     [B, T] long    1 on prompt and completion tokens
    completion_mask    [B, T] bool    True on completion tokens that are trained on (the policy's; not a
                                      multi-turn episode's environment tokens, Row.mask)
    behavior_logprobs  [B, T] float   log pi_b of each completion token (0 elsewhere)
    advantages         [B]    float   group advantage of each row
    rewards            [B]    float   reward of each row
    versions           [B]    long    policy version (optimizer step of the weights) that sampled each row
    prompt_ids         [B]    long    index of each row's prompt in its source (for audits)
    prox_logprobs      [B, T] float   log pi_prox: the trainer's own logprobs with the weights that start the
                                      batch's phase (lit_ess.callbacks.ProximalLogprobs), or None
    prox_version       int            the optimizer step whose weights give pi_prox (-1: none). The batch
                                      trained at the phase's first step has this step's version and no
                                      prox_logprobs: its own gradient pass computes them (lp.detach()).

plus what the step needs to score tokens as the engine sampled them (`sampling`: temperature, top_k,
top_p, max_new_tokens, and `engine_dtype`, the dtype whose logprobs match the trainer's, for the ESS
alarm; None when none does), the texts for logging, the rollout statistics of the phase the rows come
from, and `max_staleness`: the trainer refuses a batch whose oldest row is more than that many
optimizer steps old.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    rewards: Tensor
    versions: Tensor
    prompt_ids: Tensor
    sampling: dict = field(default_factory=dict)      # temperature, top_k, top_p, max_new_tokens
    prompt_texts: list[str] = field(default_factory=list)
    completion_texts: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)          # rollout/... of the phase, floats
    phase: int = 0
    index: int = 0                                     # position of this batch in its phase
    max_staleness: int = 0
    prox_logprobs: Tensor | None = None
    prox_version: int = -1

    def to_state(self) -> dict:
        """Plain containers and tensors, for checkpoints (torch.load's weights_only accepts them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "RolloutBatch":
        return cls(**state)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int | None) -> list["RolloutBatch"]:
        """Consecutive slices of `size` rows (None = one slice), each trimmed to its longest row."""
        size = self.rows if size is None else size
        return [self.select(slice(s, s + size)) for s in range(0, self.rows, size)]

    def select(self, rows: slice | list[int]) -> "RolloutBatch":
        """These rows (a slice gives views), trimmed to the longest of them."""
        idx = range(self.rows)[rows] if isinstance(rows, slice) else rows
        width = int(self.attention_mask[rows].sum(-1).max())
        return replace(
            self, input_ids=self.input_ids[rows, :width], attention_mask=self.attention_mask[rows, :width],
            completion_mask=self.completion_mask[rows, :width], behavior_logprobs=self.behavior_logprobs[rows, :width],
            advantages=self.advantages[rows], rewards=self.rewards[rows], versions=self.versions[rows],
            prompt_ids=self.prompt_ids[rows], prompt_texts=_pick(self.prompt_texts, idx),
            completion_texts=_pick(self.completion_texts, idx),
            prox_logprobs=None if self.prox_logprobs is None else self.prox_logprobs[rows, :width])


def _pick(texts: list[str], idx) -> list[str]:
    """The texts of rows `idx`; a batch built without texts (benchmarks, tests) keeps none."""
    return [texts[i] for i in idx] if texts else []


@dataclass(kw_only=True)
class Row:
    """One sampled completion with its prompt, before padding."""
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    advantage: float
    reward: float
    version: int
    prompt_id: int
    prompt_text: str
    completion_text: str
    mask: list[bool] | None = None     # per completion token: trained on (None = every token). A multi-turn
                                       # episode's environment tokens are False: context, not the policy's


def collate(rows: list[Row], pad_id: int, **fields) -> RolloutBatch:
    """Pad rows into a RolloutBatch; `fields` fills sampling, stats, phase, index, max_staleness."""
    if not rows:
        raise ValueError("collate: no rows")
    T = max(len(r.prompt) + len(r.completion) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    comp = torch.zeros(B, T, dtype=torch.bool)
    blp = torch.zeros(B, T, dtype=torch.float32)
    for b, r in enumerate(rows):
        P, C = len(r.prompt), len(r.completion)
        input_ids[b, :P + C] = torch.tensor(r.prompt + r.completion)
        attention[b, :P + C] = 1
        comp[b, P:P + C] = True if r.mask is None else torch.tensor(r.mask, dtype=torch.bool)
        blp[b, P:P + C] = torch.tensor(r.logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention, completion_mask=comp, behavior_logprobs=blp,
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
        versions=torch.tensor([r.version for r in rows], dtype=torch.long),
        prompt_ids=torch.tensor([r.prompt_id for r in rows], dtype=torch.long),
        prompt_texts=[r.prompt_text for r in rows], completion_texts=[r.completion_text for r in rows], **fields)
