"""Unbiased pass@k: hand-computed values, the binomial form, and the cross-prompt mean."""
import math

import pytest

from lit_ess.objectives import OBJECTIVE_CLASSES
import torch
from hypothesis import given, settings, strategies as st

from lit_ess.metrics import PassAtK, pass_at_k


def test_pass_at_k_hand_computed():
    # n = 4, c = 1: pass@k = k / 4 (one passing sample among 4, k drawn without replacement)
    got = pass_at_k(torch.tensor([[True, False, False, False]]))
    assert got[0].tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
    # n = 4, c = 2: pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@3 = pass@4 = 1
    got = pass_at_k(torch.tensor([[True, True, False, False]]))
    assert got[0].tolist() == pytest.approx([0.5, 5 / 6, 1.0, 1.0], abs=1e-12)
    # c = 0: all zero
    assert pass_at_k(torch.zeros(1, 3, dtype=torch.bool))[0].tolist() == [0.0, 0.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_pass_at_k_equals_the_binomial_form(n, data):
    c = data.draw(st.integers(0, n))
    passed = torch.zeros(1, n, dtype=torch.bool)
    passed[0, torch.randperm(n)[:c]] = True
    got = pass_at_k(passed)[0]
    for k in range(1, n + 1):
        want = 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)
        assert got[k - 1].item() == pytest.approx(want, abs=1e-12)
    assert all(a <= b + 1e-12 for a, b in zip(got, got[1:]))       # pass@k grows with k


def test_metric_averages_over_prompts_of_all_updates():
    m = PassAtK()
    m.update(torch.tensor([[True, False]]))          # pass@1 0.5, pass@2 1
    m.update(torch.tensor([[False, False], [True, True]]))   # 0, 0 and 1, 1
    assert m.compute().tolist() == pytest.approx([0.5, 2 / 3])


# ---------------------------------------------------------------- how logged metrics combine over ranks


def _reduce_main(rank, world, port, out):
    import os

    import torch.distributed as dist

    from lit_ess.metrics import reduce_over_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # rank 0: 3 rows with rewards 0, 1, 1; rank 1: 3 rows with rewards 0, 0, 1
        rewards = [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]][rank]
        r = torch.tensor(rewards)
        stats = {"rollout/rows": 3.0, "rollout/reward_mean": float(r.mean()), "rollout/reward_std": float(r.std()),
                 "rollout/response_len_max": [5.0, 9.0][rank], "rollout/gen_seconds": [2.0, 1.0][rank],
                 "train/grad_norm": 0.7, "perf/weight_sync_seconds": [0.1, 0.2][rank]}
        step = {"loss": [0.25, 0.5][rank], "ratio_mean": [1.0, 2.0][rank], "ratio_min": [0.5, 0.25][rank]}
        if rank == 0:                     # a rank without valid tokens has no ratio_max
            step["ratio_max"] = torch.tensor(3.0, dtype=torch.float64)
        got = {"stats": reduce_over_ranks(stats), "step": reduce_over_ranks(step, [0.25, 0.75][rank], prefix="train/")}
        try:
            reduce_over_ranks({"train/new_thing": 1.0})
        except KeyError as e:
            got["error"] = str(e)
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_reduce_over_ranks_hand_computed(tmp_path):
    """Two gloo ranks: each rule gives the hand-computed value of the pooled rows."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_reduce_main, args=(r, 2, port, tmp_path / "out.pt")) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = torch.load(tmp_path / "out.pt")
    stats, step = got["stats"], got["step"]
    all_rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    assert stats["rollout/rows"] == 6.0                                          # sum
    assert stats["rollout/reward_mean"] == pytest.approx(0.5)                    # rank mean (equal rows)
    assert stats["rollout/reward_std"] == pytest.approx(float(all_rewards.std()), abs=1e-7)   # pooled: 0.5477
    assert stats["rollout/response_len_max"] == 9.0 and stats["rollout/gen_seconds"] == 2.0   # max
    assert stats["train/grad_norm"] == 0.7                                       # same on every rank
    assert stats["perf/weight_sync_seconds"] == pytest.approx(0.1)               # rank 0's own
    assert step["loss"] == pytest.approx(0.75)                                   # sum of normalised parts
    assert step["ratio_mean"] == pytest.approx(0.25 * 1.0 + 0.75 * 2.0)          # token-weighted: 1.75
    assert step["ratio_min"] == 0.25 and step["ratio_max"] == 3.0                # min; max of the rank that has it
    assert "'train/new_thing' has no rule" in got["error"]


def test_an_undeclared_key_is_an_error_with_one_rank():
    from lit_ess.metrics import reduce_over_ranks, rule

    assert reduce_over_ranks({"rollout/reward_mean": 0.5}) == {"rollout/reward_mean": 0.5}
    with pytest.raises(KeyError, match="'train/new_thing' has no rule in lit_ess.metrics.RULES"):
        reduce_over_ranks({"new_thing": 1.0}, prefix="train/")
    assert rule("val/pass@3") == rule("val/pass@k")


@pytest.mark.parametrize("cls", OBJECTIVE_CLASSES, ids=lambda c: c.__name__)
def test_every_metric_an_objective_makes_has_a_rule(cls):
    """Each objective with every optional term on: its metrics, by their logged names, are declared."""
    from lit_ess.metrics import rule
    from lit_ess.objectives import ISCorrection

    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=g) - 2
    out = cls(entropy_coef=0.1, ref_kl_coef=0.1, correction=ISCorrection())(
        lp, lp + 0.1 * torch.randn(3, 5, generator=g), torch.randn(3, generator=g), torch.ones(3, 5, dtype=torch.bool),
        ess=torch.tensor(0.9), ref_logprobs=lp - 0.1, entropy=torch.rand(3, 5, generator=g), proximal_logprobs=lp - 0.05)
    undeclared = []
    for k in out.metrics:
        try:
            rule(k)
        except KeyError:
            undeclared.append(k)
    assert not undeclared, undeclared


def test_every_dashboard_chart_holds_keys_of_one_scale():
    """TensorBoard's custom-scalars charts autoscale to their data and read their tags as regular
    expressions: a chart readable at a glance shows keys of one scale (ESS alone shows a drop to 0.99;
    the learning rate is not flattened under the loss). Each chart's tags are matched, as TensorBoard
    matches them, against every key lit-ess logs (lit_ess.metrics.RULES)."""
    import re

    from lit_ess.callbacks.ratio_dashboard import LAYOUT, SCALE
    from lit_ess.metrics import RULES

    keys = [k for k in RULES if not k.endswith(("/NAME", "@k"))]
    assert set(SCALE) <= set(keys), f"SCALE names keys lit-ess never logs: {set(SCALE) - set(keys)}"
    for category, charts in LAYOUT.items():
        for title, (kind, tags) in charts.items():
            assert kind == "Multiline"
            for tag in tags:
                assert any(re.search(tag, k) for k in keys), f"{category}/{title}: {tag!r} matches no logged key"
            shown = [k for k in keys if any(re.search(tag, k) for tag in tags)]
            scales = {k: SCALE.get(k, "undeclared") for k in shown}
            assert len(set(scales.values())) == 1, f"{category}/{title} mixes scales: {scales}"
            assert "undeclared" not in scales.values(), f"{category}/{title}: {scales}"
