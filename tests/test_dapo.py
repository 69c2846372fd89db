"""DAPO's data side (lit_ess/rollout/dapo.py): the overlong penalty against hand-computed values, the knobs'
checks, a phase's refill rounds with the fake engine in sync and async (filled with groups that carry a
signal, bounded by max_rounds and counted, the prompt cursor advanced by exactly the rounds drawn, a resume
in the middle of a fill), and one `lit-ess fit` with both knobs on, read back from TensorBoard."""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
import yaml

from e2e_utils import cli_each, rl_config, scalars, write_config
from fake_engine import FakeConfig
from test_async import drive, weights
from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.sampling import SamplingConfig
from lit_ess.rollout import DynamicSampling, OverlongPenalty, overlong_penalty
from lit_ess.rollout.dapo import merge_round_stats
from lit_ess.datamodules.settings import BatchShape, Schedule

COUNTS = ("rollout/refill_rounds", "rollout/batch_short", "rollout/dropped_groups", "rollout/surplus_groups")


# ------------------------------------------------------------------------------------------------ overlong penalty
@pytest.mark.parametrize("length, expected", [(0, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75),
                                              (20, -1.0), (21, -1.0), (64, -1.0)])
def test_overlong_penalty_hand_computed(length, expected):
    # L_max 20, L_cache 4: nothing up to 16 tokens, then (16 - |y|) / 4, -1 past 20
    assert overlong_penalty(torch.tensor([length]), 20, 4).item() == pytest.approx(expected)
    assert overlong_penalty(torch.tensor([length]), 20, 4, factor=0.5).item() == pytest.approx(expected / 2)


def test_overlong_penalty_at_dapos_own_lengths():
    # DAPO's recipe: 20,480 tokens at most, the last 4,096 the buffer (None = a fifth of max_length)
    knob = OverlongPenalty(enable=True).resolved(max_new_tokens=20480)
    assert (knob.max_length, knob.buffer, knob.factor) == (20480, 4096, 1.0)
    got = overlong_penalty(torch.tensor([16384, 16385, 18432, 20480]), knob.max_length, knob.buffer)
    assert got.tolist() == pytest.approx([0.0, -1 / 4096, -0.5, -1.0])
    assert OverlongPenalty(enable=True).resolved(max_new_tokens=4).buffer == 1          # at least one token


def test_knobs_are_refused_on_one_line_naming_them(tiny_model_dir):
    bad = [(lambda: DynamicSampling(max_rounds=0), r"^dynamic_sampling.max_rounds must be an integer >= 1, got 0$"),
           (lambda: DynamicSampling(metric="acc"), r"^dynamic_sampling.metric='acc' is not one of \('reward', 'shaped'\)$"),
           (lambda: OverlongPenalty(factor=0.0), r"^overlong.factor must be > 0, got 0.0$"),
           (lambda: OverlongPenalty(buffer=10, max_length=8), r"^overlong.buffer=10 exceeds overlong.max_length=8"),
           (lambda: RolloutDataModule(model_path=tiny_model_dir, sampling=SamplingConfig(max_new_tokens=8),
                                      overlong=OverlongPenalty(enable=True, buffer=9)),
            r"^overlong.buffer=9 exceeds the max_length 8 \(overlong.max_length, else sampling.max_new_tokens\)"),
           (lambda: RolloutDataModule(model_path=tiny_model_dir, sampling=SamplingConfig(max_new_tokens=8),
                                      overlong=OverlongPenalty(enable=True, buffer=8, max_length=40)),
            r"^overlong: the penalty starts past 32 tokens .* no completion of sampling.max_new_tokens=8 reaches"),
           (lambda: RolloutDataModule(model_path=tiny_model_dir, drop_degenerate=True,
                                      dynamic_sampling=DynamicSampling(enable=True)),
            r"^drop_degenerate and dynamic_sampling.enable: .*set one of the two$")]
    for make, says in bad:
        with pytest.raises(ValueError, match=says) as e:
            make()
        assert "\n" not in str(e.value)


def test_round_statistics_merge_as_over_all_samples():
    """A phase's reward mean and std are those of every sample of its rounds; sums, maxima, last counters."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(8, generator=g), torch.rand(12, generator=g)

    def stats(r, seconds, errors):
        return {"rollout/reward_mean": float(r.mean()), "rollout/reward_std": float(r.std()), "rollout/rows": float(r.numel()),
                "rollout/response_len": 3.0, "rollout/response_len_max": float(r.numel()), "rollout/gen_seconds": seconds,
                "rollout/reward_errors": errors, "rollout/dropped_groups": 1.0, "rollout/gen_tokens_per_s": 0.0,
                "rollout/multi_version_frac": 0.0}
    m = merge_round_stats([stats(a, 1.0, 2.0), stats(b, 3.0, 5.0)])
    both = torch.cat([a, b])
    assert m["rollout/reward_mean"] == pytest.approx(float(both.mean()))
    assert m["rollout/reward_std"] == pytest.approx(float(both.std()))
    assert (m["rollout/rows"], m["rollout/response_len_max"], m["rollout/gen_seconds"], m["rollout/reward_errors"],
            m["rollout/dropped_groups"]) == (20.0, 12.0, 4.0, 5.0, 2.0)
    assert m["rollout/gen_tokens_per_s"] == pytest.approx(60 / 4)
    with pytest.raises(KeyError, match="'rollout/new_thing' has no rule"):
        merge_round_stats([{**stats(a, 1.0, 0.0), "rollout/new_thing": 1.0}])


# ------------------------------------------------------------------------------------------------ with the fake engine
def make_dm(model_dir, mode="sync", reward="e2e_utils:signal_if_even", max_rounds=4, prompts=4, samples=2, k=1,
            length=3, max_new_tokens=3, setup=True, S=None, **kw):
    """The fake engine (completions of `length` tokens), 4 prompts x 2 samples; dynamic sampling with
    `max_rounds` (0: off)."""
    if max_rounds:
        kw["dynamic_sampling"] = DynamicSampling(enable=True, max_rounds=max_rounds)
    dm = RolloutDataModule(model_path=model_dir, engine=FakeConfig(latency=0.0, length=length), schedule=Schedule(mode=mode, max_staleness=S),
                           batch=BatchShape(steps_per_rollout=k, prompts_per_rollout=prompts, samples_per_prompt=samples),
                           source=Arithmetic(size=400), sampling=SamplingConfig(max_new_tokens=max_new_tokens, seed=0),
                           reward=reward, **kw)
    if setup:
        dm.setup("fit")
    return dm


def run(model_dir, steps: int, **kw):
    """The data module of make_dm(**kw) driven for `steps` steps, and its batches."""
    dm = make_dm(model_dir, **kw)
    try:
        return dm, drive(dm, steps)
    finally:
        dm.teardown("fit")


def groups_of(batch) -> dict[int, list[float]]:
    g = defaultdict(list)
    for pid, r in zip(batch.prompt_ids.tolist(), batch.rewards.tolist()):
        g[pid].append(r)
    return g


def test_overlong_penalty_reaches_the_rows_and_the_statistics(tiny_model_dir):
    """Fake completions of 3 tokens, L_max 4, L_cache 2: each loses (2 - 3) / 2 = 0.5; reward_mean stays the
    task reward (0: no digits), the rows hold the shaped one."""
    dm = make_dm(tiny_model_dir, reward="e2e_utils:digit_fraction", max_rounds=0, max_new_tokens=4,
                 overlong=OverlongPenalty(enable=True, buffer=2))
    try:
        dm.push_weights(weights(0), 0)
        b = dm.generate_phase()[0]
    finally:
        dm.teardown("fit")
    assert b.rewards.tolist() == [-0.5] * 8
    assert (b.stats["rollout/reward_mean"], b.stats["rollout/overlong_frac"], b.stats["rollout/overlong_penalty"]) == \
        (0.0, 1.0, -0.5)
    assert "rollout/refill_rounds" not in b.stats                          # no dynamic sampling: no refill counts


def test_overlong_penalty_of_an_episode_counts_the_policys_tokens_of_all_its_turns(tiny_model_dir):
    """Multi-turn (retry_arithmetic, up to 3 turns of 4 tokens): the same seeded episodes with and without the
    penalty differ in each row's reward by exactly the penalty of its policy tokens (mask 1), L_max 8, L_cache 4;
    without max_length the knob is refused (one turn's cap would punish every long episode)."""
    from test_multiturn import RETRY, data_module

    got = {}
    for key, knob in (("plain", OverlongPenalty()), ("shaped", OverlongPenalty(enable=True, max_length=8, buffer=4))):
        dm = data_module(tiny_model_dir, overlong=knob)
        try:
            (got[key],) = dm.generate_phase()
        finally:
            dm.teardown("fit")
    plain, shaped = got["plain"], got["shaped"]
    assert torch.equal(plain.input_ids, shaped.input_ids)
    policy_tokens = shaped.completion_mask.sum(-1)
    assert int(policy_tokens.max()) > 4                                     # some episodes reach the buffer
    want = overlong_penalty(policy_tokens, 8, 4)
    assert torch.allclose(shaped.rewards - plain.rewards, want)
    assert shaped.stats["rollout/overlong_penalty"] == pytest.approx(float(want.mean()))
    assert shaped.stats["rollout/reward_mean"] == plain.stats["rollout/reward_mean"]
    with pytest.raises(ValueError, match=r"^overlong.max_length: set it with env"):
        RolloutDataModule(model_path=tiny_model_dir, env=RETRY, overlong=OverlongPenalty(enable=True))


@pytest.mark.parametrize("mode, S", [("sync", None), ("async", 2)])
def test_refill_fills_the_phase_with_groups_that_carry_a_signal(tiny_model_dir, mode, S):
    """4 prompts x 2 samples per phase; a group has a signal when its prompt's answer is even (about half):
    rounds of 4 further prompts until 4 such groups are in, each phase trained full, every prompt drawn
    counted in some phase's rounds, none twice. Async runs up to 2 steps ahead, so phases' rounds interleave
    (test_async_refill_equals_sync covers async at the sync schedule)."""
    dm, batches = run(tiny_model_dir, 6, mode=mode, S=S)
    seen, drawn = [], 0
    for step, b in enumerate(batches):
        s = b.stats
        assert s["rollout/batch_short"] == 0.0
        groups = groups_of(b)
        assert len(groups) == 4 and all(len(set(r)) == 2 for r in groups.values())          # 4 groups, each a signal
        assert all(int(dm.source.examples[p].answer) % 2 == 0 for p in groups)
        assert int((step - b.versions).max()) <= (S or 0)                        # the staleness bound holds
        rounds = s["rollout/refill_rounds"] + 1
        # every group generated is kept, dropped or surplus
        assert s["rollout/dropped_groups"] + 4 + s["rollout/surplus_groups"] == 4 * rounds
        assert s["rollout/rows"] == 8 * rounds                                      # statistics over every round
        drawn += 4 * rounds
        seen += list(groups)
    # the cursor moved by the rounds drawn: those of the phases trained, and of those generated ahead
    ahead = sum(4 * (bs[0].stats["rollout/refill_rounds"] + 1) for bs in dm.buffer.ready.values())
    ahead += sum(4 * (len(dm.fills[p].rounds) if p in dm.fills else 0) + 4 for p in dm.requests)
    assert dm.prompt_order.cursor == drawn + ahead
    assert len(set(seen)) == len(seen)
    assert max(b.stats["rollout/refill_rounds"] for b in batches) >= 1      # refills happened
    assert [b.phase for b in batches] == list(range(6))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_refill_stops_at_max_rounds_and_trains_short_counted(tiny_model_dir, mode):
    """A reward of 0 everywhere: no group ever has a signal. Each phase runs its 3 rounds, drops all 12
    groups, says it is 4 groups short and trains the one group restored so that the step has a row."""
    dm, batches = run(tiny_model_dir, 3, mode=mode, reward="e2e_utils:zero_reward", max_rounds=3)
    for b in batches:
        assert [b.stats[k] for k in COUNTS] == [2.0, 4.0, 12.0, 0.0]
        assert b.rows == 2 and b.advantages.abs().sum() == 0
    assert dm.prompt_order.cursor == 3 * 12


def test_async_refill_equals_sync(tiny_model_dir):
    """Async with staleness 0 draws the same prompts in the same order as sync, refills included."""
    got = {mode: run(tiny_model_dir, 4, mode=mode, S=0)[1] for mode in ("sync", "async")}
    for a, b in zip(got["sync"], got["async"]):
        for f in ("input_ids", "behavior_logprobs", "advantages", "rewards", "versions", "prompt_ids"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert [a.stats[k] for k in COUNTS] == [b.stats[k] for k in COUNTS]


def test_resume_in_the_middle_of_a_fill_continues_exactly(tiny_model_dir, tmp_path):
    """A checkpoint taken after a phase's first round, its refill in flight: the kept groups and the cursor
    are in it (weights_only), the refill's request is generated again, the phase comes out the same."""
    dm = make_dm(tiny_model_dir)
    dm.push_weights(weights(0), 0)
    dm._start_admissible(0)                     # phase 0, round 0 (sync: generated at once)
    dm._collect(timeout=0.0)                    # kept what had a signal, submitted round 1
    assert 0 in dm.fills and dm.requests[0].round == 1
    torch.save(dm.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    try:
        want = [dm.next_batch(0)]
        dm.push_weights(weights(1), 1)
        want.append(dm.next_batch(1))
    finally:
        dm.teardown("fit")
    again = make_dm(tiny_model_dir)
    again.load_state_dict(state)
    try:
        got = [None, None]
        again.push_weights(weights(0), 0)
        got[0] = again.next_batch(0)
        again.push_weights(weights(1), 1)
        got[1] = again.next_batch(1)
    finally:
        again.teardown("fit")
    for a, b in zip(want, got):
        for f in ("input_ids", "advantages", "prompt_ids"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert a.stats["rollout/refill_rounds"] == b.stats["rollout/refill_rounds"]
    assert again.prompt_order.cursor == dm.prompt_order.cursor
    off = make_dm(tiny_model_dir, max_rounds=0)              # resumed with dynamic sampling off: its kept groups
    try:                                                      # would be dropped without a word
        with pytest.raises(ValueError, match=r"^this checkpoint holds a dynamic-sampling phase in the middle of its "
                                             r"fill \(phase 0: 1 round\(s\), \d+ group\(s\) kept\): resume it with "
                                             r"data.dynamic_sampling.enable true"):
            off.load_state_dict(state)
    finally:
        off.teardown("fit")


def test_dynamic_sampling_refuses_several_ranks(tiny_model_dir):
    class Two:                                  # lit_ess.rollout.Ranks of 2 (the check comes before any collective)
        rank, world = 0, 2

        def all_gather(self, obj):
            return [obj, obj]
    dm = make_dm(tiny_model_dir, setup=False)
    dm.ranks = Two()
    with pytest.raises(ValueError, match=r"^dynamic_sampling.enable on 2 data-parallel ranks: .*run it on one rank"):
        dm.setup("fit")


# ------------------------------------------------------------------------------------------------ lit-ess fit
@pytest.mark.e2e
def test_fit_with_dynamic_sampling_and_the_overlong_penalty(tiny_model_dir, tmp_path):
    """3 steps of DAPO on the tiny model (the hf engine, sync: dynamic sampling and the penalty are the data
    module's, not the engine's), 8 prompts x 4 samples, groups with a signal only when
    the answer is even, completions of up to 6 tokens penalised past 3: the counts and the penalty are in
    TensorBoard at every step, and `--print_config` shows both knobs (off by default)."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=3, objective="DAPO", extra_data={
        "reward": "e2e_utils:signal_if_even", "dynamic_sampling": {"enable": True, "max_rounds": 3},
        "overlong": {"enable": True, "buffer": 3}})
    path = write_config(cfg, tmp_path / "config.yaml")
    plain = rl_config(tiny_model_dir, tmp_path / "plain")
    plain_path = write_config(plain, tmp_path / "plain.yaml")
    # both configs printed, then the run, in one process (e2e_utils.cli_each): one start of Lightning, not two
    printed = cli_each({"dapo": (["fit", "--config", str(path), "--print_config"], tmp_path),
                        "plain": (["fit", "--config", str(plain_path), "--print_config"], tmp_path),
                        "fit": (["fit", "--config", str(path)], tmp_path)})
    for key, want in (("dapo", {"dynamic_sampling": {"enable": True, "max_rounds": 3, "metric": "reward"},
                                "overlong": {"enable": True, "buffer": 3, "max_length": None, "factor": 1.0}}),
                      ("plain", {"dynamic_sampling": {"enable": False, "max_rounds": 4, "metric": "reward"},
                                 "overlong": {"enable": False, "buffer": None, "max_length": None, "factor": 1.0}})):
        res = printed[key]
        assert res.returncode == 0, res.stderr[-3000:]
        data = yaml.safe_load(res.stdout)["data"]["init_args"]
        assert {k: data[k] for k in want} == want

    res = printed["fit"]
    assert res.returncode == 0, res.stderr[-4000:]
    s = {k: [v for _, v in vals] for k, vals in scalars(tmp_path).items()}
    for key in (*COUNTS, "rollout/overlong_frac", "rollout/overlong_penalty"):
        assert len(s[key]) == 3, key
    for refill, short, dropped, surplus, rows in zip(*(s[k] for k in COUNTS), s["train/batch_rows"]):
        assert 0 <= refill <= 2 and dropped + 8 - short + surplus == 8 * (refill + 1)
        assert rows == 4 * (8 - short) or (short == 8 and rows == 4)
    assert all(-1.0 <= p <= 0.0 for p in s["rollout/overlong_penalty"])
    assert all(0.0 <= f <= 1.0 for f in s["rollout/overlong_frac"])
    assert max(s["rollout/dropped_groups"]) > 0 and max(s["rollout/overlong_frac"]) > 0
    assert all(math.isfinite(v) for v in s["train/loss"])
