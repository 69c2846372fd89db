"""RolloutBatch: the rows of one optimizer step, as the trainer consumes them.

Tensors are `[B, T]` over prompt + completion tokens, left-aligned and right-padded, unless noted:

    input_ids          [B, T] long    prompt tokens, then completion tokens, then padding
    attention_mask     [B, T] long    1 on prompt and completion tokens
    completion_mask    [B, T] bool    True on completion tokens that are trained on (the policy's; not a
                                      multi-turn episode's environment tokens, Row.mask)
    behavior_logprobs  [B, T] float   log pi_b of each completion token (0 elsewhere)
    token_versions     [B, T] long    policy version that sampled each completion token (0 elsewhere;
                                      several in a row when the weights changed in flight)
    advantages         [B]    float   group advantage of each row
    rewards            [B]    float   reward of each row
    versions           [B]    long    policy version (optimizer step of the weights) that sampled each row:
                                      its oldest token's, so the staleness bound holds for every token
    prompt_ids         [B]    long    index of each row's prompt in its source (for audits)
    prox_logprobs      [B, T] float   log pi_prox, scored by the trainer (`proximal`), or None
    proximal           Proximal       where pi_prox comes from; None: no step has scored the batch's phase

plus the engine's sampling settings (`sampling`, a SamplingConfig: the trainer scores tokens as the
engine sampled them) and `engine_dtype` (the dtype whose logprobs match the trainer's, for the ESS
alarm; None when none does), the texts for logging, the rollout statistics of the phase the rows come
from, and `max_staleness`: the trainer refuses a batch whose oldest row is more than that many
optimizer steps old.

Each field declares its kind once (`token`, `row`, `texts`, `config`, `plain`), and slicing
(`select`, `micro_batches`), collation (`collate`), checkpoints (`to_state` / `from_state`) and device
moves (`to`) follow from it:

    kind     select              to(device)     to_state           collate
    token    [rows, :width]      moved          tensor             the Row's completion values, 0 elsewhere
    row      [rows]              moved          tensor             one value per Row
    texts    the rows' strings   kept           list               one string per Row
    config   kept                kept           plain dict         a keyword of collate
    plain    kept                kept           as is              a keyword of collate
"""
from __future__ import annotations

from dataclasses import Field, asdict, dataclass, field, fields, replace
from functools import cache
from typing import Literal

import torch
from torch import Tensor

from .sampling import SamplingConfig

TOKEN, ROW, TEXTS, CONFIG, PLAIN = "token", "row", "texts", "config", "plain"
KINDS = (TOKEN, ROW, TEXTS, CONFIG, PLAIN)


def token(dtype: torch.dtype, row: str | None = None, **kw) -> Field:
    """A [B, T] tensor field; `row`: the Row attribute that holds its value on each completion token."""
    return field(metadata={"kind": TOKEN, "dtype": dtype, "row": row}, **kw)


def row(dtype: torch.dtype, row: str) -> Field:
    """A [B] tensor field, one value per row: the Row attribute `row`."""
    return field(metadata={"kind": ROW, "dtype": dtype, "row": row})


def texts(row: str) -> Field:
    """A list of strings, one per row (empty for a batch built without texts): the Row attribute `row`."""
    return field(default_factory=list, metadata={"kind": TEXTS, "row": row})


def config(cls: type, **kw) -> Field:
    """A typed dataclass (or None), a plain dict in checkpoints."""
    return field(metadata={"kind": CONFIG, "cls": cls}, **kw)


def plain(**kw) -> Field:
    """A value of the whole batch (numbers, a dict of floats): the same in every slice."""
    return field(metadata={"kind": PLAIN}, **kw)


def kind(f: Field) -> str:
    """The declared kind of a RolloutBatch field; a field that declares none is named."""
    k = f.metadata.get("kind")
    if k not in KINDS:
        raise ValueError(f"RolloutBatch field {f.name!r} declares no kind: give it one of lit_ess.batch's "
                         f"token(), row(), texts(), config(), plain()")
    return k


@cache
def declared(cls: type) -> tuple[tuple[Field, str], ...]:
    """(field, kind) of every field of a RolloutBatch class, read once per class."""
    return tuple((f, kind(f)) for f in fields(cls))


@dataclass(frozen=True)
class Proximal:
    """Where a batch's proximal policy pi_prox comes from: the weights of optimizer step `step`.

    source  scored:    its logprobs are the batch's `prox_logprobs` (scored when the phase started)
            own_pass:  the batch is trained at `step` itself: its gradient pass's lp.detach() are pi_prox
                       (same weights, same forward: no extra pass)
    """
    step: int
    source: Literal["scored", "own_pass"]


@dataclass
class RolloutBatch:
    input_ids: Tensor = token(torch.long)
    attention_mask: Tensor = token(torch.long)
    completion_mask: Tensor = token(torch.bool)
    behavior_logprobs: Tensor = token(torch.float32, row="logprobs")
    advantages: Tensor = row(torch.float32, "advantage")
    rewards: Tensor = row(torch.float32, "reward")
    versions: Tensor = row(torch.long, "version")
    prompt_ids: Tensor = row(torch.long, "prompt_id")
    sampling: SamplingConfig = config(SamplingConfig, default_factory=SamplingConfig)
    engine_dtype: str | None = plain(default=None)
    prompt_texts: list[str] = texts("prompt_text")
    completion_texts: list[str] = texts("completion_text")
    stats: dict = plain(default_factory=dict)          # rollout/... of the phase, floats
    phase: int = plain(default=0)
    index: int = plain(default=0)                      # position of this batch in its phase
    max_staleness: int = plain(default=0)
    prox_logprobs: Tensor | None = token(torch.float32, default=None)
    proximal: Proximal | None = config(Proximal, default=None)
    token_versions: Tensor | None = token(torch.long, row="token_versions", default=None)

    def __post_init__(self):
        if self.token_versions is None:          # built without them (a checkpoint, a benchmark): the row's
            self.token_versions = self.versions[:, None] * self.completion_mask.long()

    def to_state(self) -> dict:
        """Plain containers and tensors, for checkpoints (torch.load's weights_only accepts them)."""
        return {f.name: _plain(getattr(self, f.name)) if k == CONFIG else getattr(self, f.name)
                for f, k in declared(type(self))}

    @classmethod
    def from_state(cls, state: dict) -> "RolloutBatch":
        return cls(**{f.name: _typed(f, state[f.name]) if k == CONFIG else state[f.name]
                      for f, k in declared(cls) if f.name in state})

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def token_lags(self, step: int) -> Tensor:
        """[N] the policy lag of each trained token at optimizer `step` (row by row, in order): `step` minus
        the version that sampled it. A row's lag (`step - versions`) is its largest."""
        return (step - self.token_versions[self.completion_mask]).float()

    def micro_batches(self, size: int | None) -> list["RolloutBatch"]:
        """Consecutive slices of `size` rows (None = one slice), each trimmed to its longest row."""
        size = self.rows if size is None else size
        return [self.select(slice(s, s + size)) for s in range(0, self.rows, size)]

    def select(self, rows: slice | list[int]) -> "RolloutBatch":
        """These rows (a slice gives views), trimmed to the longest of them."""
        idx = range(self.rows)[rows] if isinstance(rows, slice) else rows
        width = int(self.attention_mask[rows].sum(-1).max())

        def part(k: str, v):
            if v is None or k in (CONFIG, PLAIN):
                return v
            if k == TOKEN:
                return v[rows, :width]
            return v[rows] if k == ROW else [v[i] for i in idx] if v else []
        return replace(self, **{f.name: part(k, getattr(self, f.name)) for f, k in declared(type(self))})

    @classmethod
    def cat(cls, batches: list["RolloutBatch"]) -> "RolloutBatch":
        """The rows of `batches` in order, in one batch as wide as the widest (token fields padded with 0);
        the batch-wide fields (sampling, proximal, stats, ...) are the first batch's. prox_logprobs must be
        set on all or none."""
        width = max(b.input_ids.shape[1] for b in batches)

        def part(f: Field, k: str):
            vs = [getattr(b, f.name) for b in batches]
            if k in (CONFIG, PLAIN):
                return vs[0]
            if k == TEXTS:
                return [t for v in vs for t in v] if all(vs) else []
            if all(v is None for v in vs):
                return None
            if any(v is None for v in vs):
                raise ValueError(f"RolloutBatch.cat: {f.name} is set on some batches only")
            if k == TOKEN:
                vs = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in vs]
            return torch.cat(vs)
        return cls(**{f.name: part(f, k) for f, k in declared(cls)})

    def to(self, device: torch.device | str, **kwargs) -> "RolloutBatch":
        """The batch with its tensors on `device` (Lightning's batch transfer calls it)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device, **kwargs) for f, k in declared(type(self))
                                if k in (TOKEN, ROW) and getattr(self, f.name) is not None})


def _plain(value):
    return None if value is None else asdict(value)


def _typed(f: Field, value):
    return value if value is None or isinstance(value, f.metadata["cls"]) else f.metadata["cls"](**value)


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
    token_versions: list[int] | None = None   # per completion token: the version that sampled it (None: all
                                              # `version`); no trained token's is older than `version`

    def __post_init__(self):
        if self.token_versions is None:
            self.token_versions = [self.version] * len(self.completion)
        if len(self.token_versions) != len(self.completion):
            raise ValueError(f"Row: {len(self.token_versions)} token versions for {len(self.completion)} tokens")
        if (own := self.versions_trained()) and min(own) < self.version:
            raise ValueError(f"Row: a token sampled by version {min(own)} in a row of version {self.version}: the "
                             f"staleness bound, checked on the row's version, would not hold for it")

    def versions_trained(self) -> list[int]:
        """The versions of the tokens trained on (the policy's)."""
        return [v for v, m in zip(self.token_versions, self.mask or [True] * len(self.completion)) if m]


def collate(rows: list[Row], pad_id: int, **values) -> RolloutBatch:
    """Pad rows into a RolloutBatch. The layout (input_ids, attention_mask, completion_mask) comes from each
    Row's prompt and completion; every other field that names a Row attribute is filled from it; `values`
    give the rest (sampling, engine_dtype, stats, phase, index, max_staleness)."""
    if not rows:
        raise ValueError("collate: no rows")
    T = max(len(r.prompt) + len(r.completion) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.long)
    comp = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(rows):
        P, C = len(r.prompt), len(r.completion)
        input_ids[b, :P + C] = torch.tensor(r.prompt + r.completion)
        attention[b, :P + C] = 1
        comp[b, P:P + C] = True if r.mask is None else torch.tensor(r.mask, dtype=torch.bool)
    out = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": comp}
    for f, k in declared(RolloutBatch):
        source = f.metadata.get("row")
        if source is None:
            continue
        if k == TOKEN:                                     # [B, T]: the row's values on its completion tokens
            t = torch.zeros(B, T, dtype=f.metadata["dtype"])
            for b, r in enumerate(rows):
                P = len(r.prompt)
                t[b, P:P + len(r.completion)] = torch.tensor(getattr(r, source), dtype=t.dtype)
            out[f.name] = t
        elif k == ROW:
            out[f.name] = torch.tensor([getattr(r, source) for r in rows], dtype=f.metadata["dtype"])
        else:
            out[f.name] = [getattr(r, source) for r in rows]
    return RolloutBatch(**out, **values)


@dataclass
class EvalResult:
    """Held-out prompts sampled `n` times each and scored (a validation batch): each sample's reward and its
    length in tokens. Not frozen: Lightning moves a batch's tensors to the device field by field."""
    reward: Tensor        # [P, n] float
    length: Tensor        # [P, n] float
