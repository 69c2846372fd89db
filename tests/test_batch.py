"""The batch contract (issue 24, item 3): every RolloutBatch field declares its kind once, and slicing,
collation, checkpoints and device moves follow from that declaration, for a field added later too."""
import io
from dataclasses import field, fields, make_dataclass

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lit_ess.batch import CONFIG, KINDS, PLAIN, ROW, TEXTS, TOKEN, Proximal, RolloutBatch, Row, collate, kind, token
from lit_ess.sampling import SamplingConfig


def _rows() -> list[Row]:
    """Three rows of different lengths, every attribute distinct per row."""
    return [Row(prompt=[5 + i] * (2 + i), completion=[20 + i] * (3 - i), logprobs=[-0.1 * (i + 1)] * (3 - i),
                advantage=float(i) - 1, reward=0.5 * i, version=i, prompt_id=10 + i, prompt_text=f"p{i}",
                completion_text=f"c{i}") for i in range(3)]


def _batch(cls=RolloutBatch, **extra) -> RolloutBatch:
    b = collate(_rows(), pad_id=0, sampling=SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=3),
                engine_dtype="float32", stats={"rollout/reward_mean": 0.5}, phase=2, index=1, max_staleness=3)
    values = {f.name: getattr(b, f.name) for f in fields(RolloutBatch)}
    values.update(prox_logprobs=torch.randn(b.input_ids.shape), proximal=Proximal(4, "scored"), **extra)
    return cls(**values)


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _check_paths(b: RolloutBatch) -> None:
    """select, micro_batches, to_state/from_state (through torch.save and a weights_only load) and to(device)
    on every field of `b`, by its declared kind."""
    part = b.select([2, 0])
    width = int(b.attention_mask[[2, 0]].sum(-1).max())
    for f in fields(b):
        v, got = getattr(b, f.name), getattr(part, f.name)
        want = {TOKEN: lambda: v[[2, 0], :width], ROW: lambda: v[[2, 0]], TEXTS: lambda: [v[2], v[0]]}.get(kind(f), lambda: v)()
        assert _equal(got, want), f.name
    first, second = b.micro_batches(2)
    assert first.rows == 2 and second.rows == 1
    for f in fields(b):
        if kind(f) in (TOKEN, ROW):
            v = getattr(b, f.name)
            assert torch.equal(getattr(second, f.name), v[2:3, :getattr(second, f.name).shape[-1]] if kind(f) == TOKEN
                               else v[2:3]), f.name

    buf = io.BytesIO()
    torch.save(b.to_state(), buf)
    buf.seek(0)
    again = type(b).from_state(torch.load(buf, weights_only=True))
    for f in fields(b):
        assert _equal(getattr(again, f.name), getattr(b, f.name)), f.name
        assert type(getattr(again, f.name)) is type(getattr(b, f.name)), f.name

    for moved in (b.to("meta"), move_data_to_device(b, torch.device("meta"))):     # Lightning's batch transfer
        for f in fields(b):
            v = getattr(moved, f.name)
            if kind(f) in (TOKEN, ROW):
                assert v.device.type == "meta", f.name
            else:
                assert _equal(v, getattr(b, f.name)), f.name


def test_every_field_declares_its_kind():
    assert {f.name: kind(f) for f in fields(RolloutBatch)} and all(kind(f) in KINDS for f in fields(RolloutBatch))


def test_every_path_follows_the_declaration():
    _check_paths(_batch())


def test_a_field_added_with_a_kind_is_carried_by_every_path():
    """A new [B, T] and a new [B] field, declared and nothing else: sliced, checkpointed and moved."""
    Wider = make_dataclass("Wider", [("extra_token", torch.Tensor | None, token(torch.float32, default=None)),
                                     ("extra_row", torch.Tensor | None, field(default=None, metadata={"kind": ROW}))],
                           bases=(RolloutBatch,))
    b = _batch(Wider, extra_token=torch.randn(3, 5), extra_row=torch.arange(3) * 7)
    _check_paths(b)


def test_a_field_without_a_kind_is_named_by_every_path():
    Bare = make_dataclass("Bare", [("extra", torch.Tensor | None, field(default=None))], bases=(RolloutBatch,))
    b = _batch(Bare, extra=torch.zeros(3, 5))
    for path in (lambda: b.select([0]), lambda: b.micro_batches(2), b.to_state, lambda: b.to("cpu")):
        with pytest.raises(ValueError, match="RolloutBatch field 'extra' declares no kind"):
            path()


def test_collate_fills_every_row_attribute():
    """Each Row attribute reaches the batch: the layout (prompt, completion) and every field that names one."""
    rows, b = _rows(), _batch()
    sources = {f.metadata["row"]: f for f in fields(RolloutBatch) if f.metadata.get("row")}
    assert set(sources) | {"prompt", "completion", "mask"} == {f.name for f in fields(Row)}   # mask: the layout's
    for i, r in enumerate(rows):
        P, C = len(r.prompt), len(r.completion)
        assert b.input_ids[i, :P + C].tolist() == r.prompt + r.completion and not b.attention_mask[i, P + C:].any()
        assert b.completion_mask[i].nonzero().flatten().tolist() == list(range(P, P + C))
        for attr, f in sources.items():
            v = getattr(b, f.name)[i]
            if kind(f) == TOKEN:
                assert torch.allclose(v[P:P + C], torch.tensor(getattr(r, attr))) and not v[:P].any(), f.name
            else:
                assert (v.item() if kind(f) == ROW else v) == pytest.approx(getattr(r, attr)), f.name
    assert b.sampling.temperature == 0.7 and b.engine_dtype == "float32" and b.proximal == Proximal(4, "scored")
    assert {kind(f) for f in fields(RolloutBatch)} == {TOKEN, ROW, TEXTS, CONFIG, PLAIN}


def test_cat_puts_selected_rows_back_together():
    """RolloutBatch.cat of slices of a batch (each trimmed to its own longest row) is the batch again, in
    the slices' order: token fields padded back to the widest, row fields and texts concatenated."""
    rows = [Row(prompt=[3] * (2 + i), completion=[5] * (1 + i % 3), logprobs=[-0.5] * (1 + i % 3), advantage=float(i),
                reward=0.0, version=i, prompt_id=i, prompt_text=f"p{i}", completion_text=f"c{i}") for i in range(5)]
    batch = collate(rows, pad_id=0, sampling=SamplingConfig(max_new_tokens=3))
    parts = [batch.select([3, 1]), batch.select([0]), batch.select([4, 2])]
    assert parts[1].input_ids.shape[1] < batch.input_ids.shape[1]
    got = RolloutBatch.cat(parts)
    want = batch.select([3, 1, 0, 4, 2])
    for f, k in ((f, kind(f)) for f in fields(RolloutBatch)):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    with pytest.raises(ValueError, match="prox_logprobs is set on some batches only"):
        parts[0].prox_logprobs = torch.zeros_like(parts[0].behavior_logprobs)
        RolloutBatch.cat(parts)
