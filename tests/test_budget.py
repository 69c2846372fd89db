"""Token-budget micro-batches (PolicyModule.micro_batch_tokens): the step is cut by length, not by row count,
and the update does not move: every objective x every aggregation gives the loss, gradient and ESS of one
padded batch, and the proximal logprobs are written back to their own rows."""
from dataclasses import replace

import pytest
import torch

from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.engines import HFConfig, SamplingConfig
from lit_ess.module import PolicyModule
from lit_ess.objectives import AGGREGATIONS, GRPO, OBJECTIVE_CLASSES
from lit_ess.rollout import Proximal

BUDGET = 50        # rows x longest row (prompt + completion tokens) per micro-batch, on the batch below


@pytest.fixture(scope="module")
def stale_batch(tiny_model_dir):
    """16 rows of different lengths, behaviour logprobs perturbed (ESS < 1) and proximal logprobs that are
    neither the behaviour's nor the policy's (for the objectives that use them)."""
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), prompts_per_rollout=4, samples_per_prompt=4,
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), source=Arithmetic(size=50),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    batch = dm.generate_phase()[0]
    cut = {k: getattr(batch, k).clone() for k in ("attention_mask", "completion_mask")}
    ends = batch.attention_mask.sum(-1)
    for r in range(batch.rows):           # completions of different lengths: row r ends r % 5 tokens early
        drop = min(r % 5, int(batch.completion_mask[r].sum()) - 1)
        for k in cut:
            cut[k][r, int(ends[r]) - drop:] = 0
    batch = replace(batch, **cut)
    g = torch.Generator().manual_seed(0)
    m = batch.completion_mask
    batch.behavior_logprobs = torch.where(m, batch.behavior_logprobs + 0.3 * torch.randn(m.shape, generator=g), 0.0)
    batch.prox_logprobs = torch.where(m, batch.behavior_logprobs + 0.2 * torch.randn(m.shape, generator=g), 0.0)
    batch.proximal = Proximal(0, "scored")
    batch.advantages = torch.randn(m.shape[0], generator=g)
    return batch


def module(model_dir, objective, **kw) -> PolicyModule:
    m = PolicyModule(model_dir, objective=objective, **kw)
    m.configure_model()
    return m


def test_the_budget_cuts_by_length(tiny_model_dir, stale_batch):
    """Hand-checked on the batch: each micro-batch holds <= BUDGET padded tokens (rows x its longest
    row) unless it is one row, is trimmed to that row, every row is in exactly one, and the row counts
    differ (3 or more micro-batches), unlike micro_batch_size's equal slices."""
    lengths = stale_batch.attention_mask.sum(-1).tolist()
    assert len(set(lengths)) > 1
    cuts = module(tiny_model_dir, GRPO(), micro_batch_tokens=BUDGET).micro_batches(stale_batch)
    assert len(cuts) >= 3 and len({len(rows) for rows, _ in cuts}) > 1
    assert sorted(r for rows, _ in cuts for r in rows) == list(range(stale_batch.rows))
    for rows, mb in cuts:
        longest = max(lengths[r] for r in rows)
        assert len(rows) * longest <= BUDGET or len(rows) == 1
        assert mb.input_ids.shape == (len(rows), longest)
        assert torch.equal(mb.input_ids, stale_batch.input_ids[rows, :longest])


def _step(model_dir, batch, objective, **kw):
    m = module(model_dir, objective, **kw)
    metrics, ess = m.accumulate_gradients(replace(batch))
    return torch.cat([p.grad.flatten() for p in m.policy.parameters()]), metrics, ess


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("objective", [*OBJECTIVE_CLASSES, "GRPO-old-proximal"],
                         ids=lambda c: c if isinstance(c, str) else c.__name__)
def test_the_update_does_not_depend_on_the_cut(tiny_model_dir, stale_batch, objective, aggregation):
    """One padded batch, micro_batch_size 2 (8 equal slices) and micro_batch_tokens (3+ unequal
    micro-batches by length): the same loss, gradient and ESS to 1e-5."""
    make = (lambda: GRPO(old="proximal", aggregation=aggregation)) if objective == "GRPO-old-proximal" \
        else (lambda: objective(aggregation=aggregation))
    g0, m0, e0 = _step(tiny_model_dir, stale_batch, make())
    assert m0["train/ess"] < 0.99                              # off-policy: the ESS is doing something
    for kw in ({"micro_batch_size": 2}, {"micro_batch_tokens": BUDGET}):
        g, m, e = _step(tiny_model_dir, stale_batch, make(), **kw)
        assert torch.allclose(g, g0, atol=1e-5, rtol=1e-4), kw
        for k in ("train/loss", "train/policy_loss", "train/ess", "train/tokens"):
            assert m[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (kw, k)
        assert (e is None) == (e0 is None) and (e is None or float(e) == pytest.approx(float(e0), rel=1e-5)), kw


def test_proximal_scoring_writes_back_by_row(tiny_model_dir, stale_batch):
    """score_proximal in token-budget micro-batches (rows out of order) gives each row the logprobs one
    padded forward gives it."""
    got, want = replace(stale_batch), replace(stale_batch)
    module(tiny_model_dir, GRPO(), micro_batch_tokens=BUDGET).score_proximal([got], pad=got)
    module(tiny_model_dir, GRPO()).score_proximal([want], pad=want)
    m = stale_batch.completion_mask
    assert torch.allclose(got.prox_logprobs[m], want.prox_logprobs[m], atol=1e-5)


def test_reference_kl_uses_the_same_micro_batches(tiny_model_dir, stale_batch):
    """The reference model is scored on the gradient pass's micro-batches: KL to the reference is the
    same as one padded batch's."""
    m0 = _step(tiny_model_dir, stale_batch, GRPO(ref_kl_coef=0.1), ref_model_path=tiny_model_dir)[1]
    m1 = _step(tiny_model_dir, stale_batch, GRPO(ref_kl_coef=0.1), ref_model_path=tiny_model_dir,
               micro_batch_tokens=BUDGET)[1]
    assert m1["train/kl_ref"] == pytest.approx(m0["train/kl_ref"], abs=1e-7)
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-5, abs=1e-6)


def test_the_two_knobs_are_alternatives(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^model.micro_batch_size=2 and model.micro_batch_tokens=64 are alternatives"):
        PolicyModule(tiny_model_dir, micro_batch_size=2, micro_batch_tokens=64)
    with pytest.raises(ValueError, match=r"^model.micro_batch_tokens must be an integer >= 1 or null, got 0$"):
        PolicyModule(tiny_model_dir, micro_batch_tokens=0)
