"""Token-budget micro-batches (PolicyModule.micro_batch_tokens) and padding-free packing (PolicyModule.packing):
the step is cut by length, not by row count, and packed rows are scored without padding, and the update
does not move: every objective x every aggregation gives the loss, gradient and ESS of one padded batch,
on 1 and 2 ranks, and the proximal and reference logprobs are written back to their own rows."""
import os
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from e2e_utils import off_policy, sampled_batch, spawn_ranks
from lit_ess.sampling import SamplingConfig
from lit_ess.module import PolicyModule
from lit_ess.objectives import AGGREGATIONS, GRPO, OBJECTIVE_CLASSES, P3O
from lit_ess.batch import Proximal, Row, collate
from lit_ess.settings import MicroBatch

BUDGET = 50        # rows x longest row (prompt + completion tokens) per micro-batch, on the batch below
CUTS = {"rows": {"micro_batch": MicroBatch(size=2)}, "budget": {"micro_batch": MicroBatch(tokens=BUDGET)},
        "packed": {"micro_batch": MicroBatch(packing=True)},
        "packed_budget": {"micro_batch": MicroBatch(packing=True, tokens=BUDGET)}}     # against one padded batch


@pytest.fixture(scope="module")
def stale_batch(tiny_model_dir):
    """16 rows of different lengths, behaviour logprobs perturbed (ESS < 1) and proximal logprobs that are
    neither the behaviour's nor the policy's (for the objectives that use them)."""
    batch = sampled_batch(tiny_model_dir)
    cut = {k: getattr(batch, k).clone() for k in ("attention_mask", "completion_mask")}
    ends = batch.attention_mask.sum(-1)
    for r in range(batch.rows):           # completions of different lengths: row r ends r % 5 tokens early
        drop = min(r % 5, int(batch.completion_mask[r].sum()) - 1)
        for k in cut:
            cut[k][r, int(ends[r]) - drop:] = 0
    return off_policy(replace(batch, **cut))


@pytest.fixture(scope="module")
def tailed_batch():
    """16 rows of 4-37 tokens (prompts of 3-7, completions long-tailed: most short, two at 30), random
    tokens, behaviour logprobs away from the policy's (ESS < 1): packed in lines as wide as the longest row,
    most lines hold several rows, so a row that attended to another would change its logprobs."""
    g = torch.Generator().manual_seed(1)
    completions = [30, 2, 5, 1, 9, 3, 2, 14, 1, 4, 30, 6, 2, 3, 7, 1]
    rows = [Row(prompt=torch.randint(3, 200, (3 + i % 5,), generator=g).tolist(),
                completion=torch.randint(3, 200, (c,), generator=g).tolist(),
                logprobs=(-5.5 + 0.5 * torch.randn(c, generator=g)).tolist(),
                advantage=float(torch.randn((), generator=g)), reward=0.0, version=0, prompt_id=i // 4,
                prompt_text="", completion_text="") for i, c in enumerate(completions)]
    batch = collate(rows, pad_id=0, sampling=SamplingConfig(max_new_tokens=30))
    batch.prox_logprobs = torch.where(batch.completion_mask, batch.behavior_logprobs + 0.2 * torch.randn(
        batch.completion_mask.shape, generator=g), 0.0)
    batch.proximal = Proximal(0, "scored")
    return batch


def module(model_dir, objective, **kw) -> PolicyModule:
    m = PolicyModule(model_dir, objective=objective, **kw)
    m.configure_model()
    return m


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """The tiny model loaded once for the steps that share it (_step_on resets its gradients; no step here
    moves its weights): a load per step was most of this file's time."""
    return module(tiny_model_dir, GRPO()).policy


def test_the_budget_cuts_by_length(tiny_model_dir, stale_batch):
    """Hand-checked on the batch: each micro-batch holds <= BUDGET padded tokens (rows x its longest
    row) unless it is one row, is trimmed to that row, every row is in exactly one, and the row counts
    differ (3 or more micro-batches), unlike micro_batch_size's equal slices."""
    lengths = stale_batch.attention_mask.sum(-1).tolist()
    assert len(set(lengths)) > 1
    cuts = module(tiny_model_dir, GRPO(), micro_batch=MicroBatch(tokens=BUDGET)).micro_batches(stale_batch)
    assert len(cuts) >= 3 and len({len(rows) for rows, _ in cuts}) > 1
    assert sorted(r for rows, _ in cuts for r in rows) == list(range(stale_batch.rows))
    for rows, mb in cuts:
        longest = max(lengths[r] for r in rows)
        assert len(rows) * longest <= BUDGET or len(rows) == 1
        assert mb.input_ids.shape == (len(rows), longest)
        assert torch.equal(mb.input_ids, stale_batch.input_ids[rows, :longest])


def _grads(m: PolicyModule) -> Tensor:
    """The trainable parameters' gradients, flattened."""
    return torch.cat([p.grad.flatten() for p in m.policy.parameters() if p.requires_grad])


def _step(model_dir, batch, objective, **kw):
    m = module(model_dir, objective, **kw)
    metrics, ess = m.accumulate_gradients(replace(batch))
    return _grads(m), metrics, ess


def make_objective(objective, aggregation):
    """A fresh objective of a class of OBJECTIVE_CLASSES (or GRPO with the proximal policy as old policy)."""
    if objective == "GRPO-old-proximal":
        return GRPO(old="proximal", aggregation=aggregation)
    return objective(aggregation=aggregation)


OBJECTIVES = [*OBJECTIVE_CLASSES, "GRPO-old-proximal"]


@pytest.mark.parametrize("data", ["stale_batch", "tailed_batch"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda c: c if isinstance(c, str) else c.__name__)
def test_the_update_does_not_depend_on_the_cut(tiny_model_dir, policy, objective, aggregation, data, request):
    """One padded batch, micro_batch_size 2 (8 equal slices), micro_batch_tokens (3+ unequal
    micro-batches by length), packing (one micro-batch, rows packed) and packing with the budget: the
    same loss, gradient and ESS to 1e-5, on sampled rows of 9-13 tokens and on long-tailed ones."""
    batch = request.getfixturevalue(data)
    make = lambda: make_objective(objective, aggregation)      # noqa: E731
    g0, m0, e0 = _step_on(policy, tiny_model_dir, batch, make())
    assert m0["train/ess"] < 0.99                              # off-policy: the ESS is doing something
    for kw in CUTS.values():
        g, m, e = _step_on(policy, tiny_model_dir, batch, make(), **kw)
        assert torch.allclose(g, g0, atol=1e-5, rtol=1e-4), kw
        for k in ("train/loss", "train/policy_loss", "train/ess", "train/tokens"):
            assert m[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (kw, k)
        assert (e is None) == (e0 is None) and (e is None or float(e) == pytest.approx(float(e0), rel=1e-5)), kw


@pytest.mark.parametrize("cut", ["budget", "packed_budget"])
def test_proximal_scoring_writes_back_by_row(tiny_model_dir, stale_batch, cut):
    """score_proximal in token-budget micro-batches (rows out of order; packed or not) gives each row the
    logprobs one padded forward gives it."""
    got, want = replace(stale_batch), replace(stale_batch)
    module(tiny_model_dir, GRPO(), **CUTS[cut]).score_proximal([got], pad=got)
    module(tiny_model_dir, GRPO()).score_proximal([want], pad=want)
    m = stale_batch.completion_mask
    assert torch.allclose(got.prox_logprobs[m], want.prox_logprobs[m], atol=1e-5)


@pytest.mark.parametrize("cut", ["budget", "packed_budget"])
def test_reference_kl_uses_the_same_micro_batches(tiny_model_dir, stale_batch, cut):
    """The reference model is scored on the gradient pass's micro-batches (packed or not): KL to the
    reference is the same as one padded batch's."""
    m0 = _step(tiny_model_dir, stale_batch, GRPO(ref_kl_coef=0.1), ref_model_path=tiny_model_dir)[1]
    m1 = _step(tiny_model_dir, stale_batch, GRPO(ref_kl_coef=0.1), ref_model_path=tiny_model_dir, **CUTS[cut])[1]
    assert m1["train/kl_ref"] == pytest.approx(m0["train/kl_ref"], abs=1e-7)
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-5, abs=1e-6)


def test_the_two_knobs_are_alternatives(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^model.micro_batch.size=2 and model.micro_batch.tokens=64 are alternatives"):
        PolicyModule(tiny_model_dir, micro_batch=MicroBatch(size=2, tokens=64))
    with pytest.raises(ValueError, match=r"^model.micro_batch.tokens must be an integer >= 1 or null, got 0$"):
        PolicyModule(tiny_model_dir, micro_batch=MicroBatch(tokens=0))


def test_packing_budget_counts_tokens(tiny_model_dir, stale_batch):
    """With packing the budget is the rows' tokens (sum of lengths), so fewer micro-batches than the
    padded budget's rows x longest row; every row once, each micro-batch trimmed to its longest row."""
    lengths = stale_batch.attention_mask.sum(-1).tolist()
    cuts = module(tiny_model_dir, GRPO(), micro_batch=MicroBatch(tokens=BUDGET, packing=True)).micro_batches(stale_batch)
    padded = module(tiny_model_dir, GRPO(), micro_batch=MicroBatch(tokens=BUDGET)).micro_batches(stale_batch)
    assert 1 < len(cuts) < len(padded)
    assert sorted(r for rows, _ in cuts for r in rows) == list(range(stale_batch.rows))
    for rows, mb in cuts:
        assert sum(lengths[r] for r in rows) <= BUDGET or len(rows) == 1
        assert mb.input_ids.shape == (len(rows), max(lengths[r] for r in rows))


def test_packed_rows_do_not_attend_to_each_other_in_the_module(tiny_model_dir, tailed_batch):
    """The module's packed forward puts several rows in one line (checked), yet changing the tokens of a row
    leaves every other row's logprobs and entropies as they were, and each row's equal its padded ones."""
    from lit_ess.packing import pack

    batch = tailed_batch
    m = module(tiny_model_dir, GRPO(entropy_coef=0.01), micro_batch=MicroBatch(packing=True))
    p = pack(batch.input_ids, batch.attention_mask, width=batch.input_ids.shape[1])
    line = next(x for x in p.segment_ids if len(x[x >= 0].unique()) > 2)    # a line of several rows
    first = int(line[0])                                            # ... whose first row is changed below
    other = replace(batch, input_ids=batch.input_ids.clone())
    n = int(batch.attention_mask[first].sum())
    other.input_ids[first, :n] = (batch.input_ids[first, :n] + 7) % 200 + 3
    with torch.no_grad():
        lp, ent = m._forward(batch, batch.sampling, True)
        lp2, ent2 = m._forward(other, other.sampling, True)
        lp0, ent0 = module(tiny_model_dir, GRPO(entropy_coef=0.01))._forward(batch, batch.sampling, True)
    c = batch.completion_mask
    keep = torch.ones(batch.rows, dtype=torch.bool)
    keep[first] = False
    assert (lp[first] - lp2[first])[c[first]].abs().max() > 1e-3          # the changed row did change
    torch.testing.assert_close(lp2[keep][c[keep]], lp[keep][c[keep]], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent2[keep][c[keep]], ent[keep][c[keep]], atol=1e-6, rtol=0)
    torch.testing.assert_close(lp[c], lp0[c], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[c], ent0[c], atol=1e-5, rtol=0)


def test_packing_knob_is_checked(tiny_model_dir, tmp_path):
    """packing takes a bool; an attention implementation that ignores packed position ids is refused by name."""
    import json
    import shutil

    with pytest.raises(ValueError, match=r"^model.micro_batch.packing must be true or false, got 'yes'$"):
        PolicyModule(tiny_model_dir, micro_batch=MicroBatch(packing="yes"))
    flex = shutil.copytree(tiny_model_dir, tmp_path / "flex")
    cfg = json.loads((flex / "config.json").read_text())
    (flex / "config.json").write_text(json.dumps({**cfg, "attn_implementation": "flex_attention"}))
    with pytest.raises(ValueError, match=r"^model.micro_batch.packing=true needs attn_implementation in .*'flex_attention'"):
        PolicyModule(str(flex), micro_batch=MicroBatch(packing=True)).configure_model()
    PolicyModule(str(flex)).configure_model()                    # without packing: no constraint


@pytest.mark.parametrize("objective", [P3O, GRPO], ids=lambda c: c.__name__)
def test_packing_with_lora(tiny_model_dir, tailed_batch, objective):
    """LoRA adapters (peft) take the packed forward too: the same loss, adapter gradients and ESS as the
    padded forward, and a reference KL through the base model (adapters off) of exactly 0 at step 0."""
    from lit_ess.lora import LoRA

    def run(**kw):
        g, m, e = _step(tiny_model_dir, tailed_batch, objective(ref_kl_coef=0.1), lora=LoRA(rank=4), **kw)
        return g, m, e

    torch.manual_seed(0)
    g0, m0, e0 = run()
    torch.manual_seed(0)
    g1, m1, e1 = run(micro_batch=MicroBatch(packing=True, tokens=BUDGET))
    assert g0.abs().sum() > 0 and torch.allclose(g1, g0, atol=1e-5, rtol=1e-4)
    for k in ("train/loss", "train/ess", "train/kl_ref"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k


# ------------------------------------------------------------------ 2 ranks (gloo)
RANK_CUTS = {"padded": {}, "budget": CUTS["budget"], "packed_budget": CUTS["packed_budget"]}
RANK_ROWS = [list(range(10)), list(range(10, 16))]      # unequal shares: the ranks' pass counts differ


def _step_on(policy, model_dir, batch, objective, **kw):
    """_step with an already loaded policy (a PolicyModule keeps a policy it is given)."""
    m = PolicyModule(model_dir, objective=objective, **kw)
    m.policy = policy
    policy.zero_grad(set_to_none=True)
    metrics, ess = m.accumulate_gradients(replace(batch))
    return _grads(m), metrics, ess


def _ranks_main(rank, world, port, model_dir, batch_file, out):
    """Every objective x aggregation x cut on this rank's share of the batch; the gradients summed over ranks
    (no DDP/FSDP wrapper: each rank's loss is already its share of the step's, normalised by global counts)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch = torch.load(batch_file, weights_only=False).select(RANK_ROWS[rank])
        policy = module(model_dir, GRPO()).policy                  # loaded once, its gradients reset per step
        got = {}
        for objective in OBJECTIVES:
            for aggregation in AGGREGATIONS:
                for cut, kw in RANK_CUTS.items():
                    g, metrics, ess = _step_on(policy, model_dir, batch, make_objective(objective, aggregation), **kw)
                    dist.all_reduce(g)
                    got[(str(objective), aggregation, cut)] = (g, metrics, None if ess is None else float(ess))
        for cut in ("budget", "packed_budget"):           # what each rank trains: its tokens and passes
            mbs, passes = module(model_dir, GRPO(), **RANK_CUTS[cut]).rank_passes(batch)
            shares = [None] * world
            dist.all_gather_object(shares, (sum(int(mb.attention_mask.sum()) for mb in mbs), len(passes)))
            got[cut] = shares
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_give_the_one_rank_update(tiny_model_dir, policy, tailed_batch, tmp_path):
    """2 gloo ranks holding 10 and 6 of the long-tailed rows, padded, by token budget and packed by token
    budget: for every objective x aggregation the gradient summed over ranks, the loss and the ESS equal one
    process's padded step on all 16 rows (to 1e-5); the ranks run the same number of passes (else hang).
    With a token budget the ranks train balanced shares: token counts within one row's length (the
    ranks' own rows are further apart than that)."""
    torch.save(tailed_batch, tmp_path / "batch.pt")
    spawn_ranks(_ranks_main, tiny_model_dir, tmp_path / "batch.pt", tmp_path / "out.pt", timeout=600,
                what="the 2-rank steps")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    lengths = tailed_batch.attention_mask.sum(-1)
    unbalanced = [int(lengths[rows].sum()) for rows in RANK_ROWS]
    for cut in ("budget", "packed_budget"):                        # rows dealt by tokens, as many passes
        (t0, n0), (t1, n1) = got[cut]
        assert t0 + t1 == int(lengths.sum()) and abs(t0 - t1) <= int(lengths.max()) < abs(unbalanced[0] - unbalanced[1])
        assert n0 == n1, cut
    for objective in OBJECTIVES:
        for aggregation in AGGREGATIONS:
            g0, m0, e0 = _step_on(policy, tiny_model_dir, tailed_batch, make_objective(objective, aggregation))
            for cut in RANK_CUTS:
                g, m, e = got[(str(objective), aggregation, cut)]
                where = (objective, aggregation, cut)
                assert torch.allclose(g, g0, atol=1e-5, rtol=1e-4), where
                for k in ("train/loss", "train/policy_loss", "train/ess", "train/tokens"):
                    assert m[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (where, k)
                assert (e is None) == (e0 is None) and (e is None or e == pytest.approx(float(e0), rel=1e-5)), where
