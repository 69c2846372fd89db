"""Rewards, advantages, prompt sources and one real rollout phase (hf engine) of the DataModule."""
import json
import time

import pytest
import torch

from lit_ess.datamodules import Arithmetic, HFPrompts, RolloutDataModule
from lit_ess.advantages import RLOO, GroupMean, degenerate_groups, resolve_advantage
from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.rewards import RewardScorer, exact_match, gsm8k, math_verify
from lit_ess.datamodules.settings import BatchShape, RewardLimits, Validation


def test_exact_match_and_gsm8k():
    assert exact_match(" 122\n", "122") == 1.0 and exact_match("12", "122") == 0.0
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k("so #### 70 ... no wait #### 72", solution) == 1.0        # last match wins
    assert gsm8k("#### 1,234", "1234") == 1.0                              # commas
    assert gsm8k("the answer is 72", solution) == 0.0                      # needs the #### marker
    assert gsm8k("#### -3.5", "-3.5") == 1.0


def test_math_verify_boxed():
    assert math_verify("so the result is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_verify("\\boxed{3}", "4") == 0.0


def _boom(c, a):
    raise RuntimeError("bad reward")


def _nan(c, a):
    return float("nan")


def _slow(c, a):
    time.sleep(600)                  # far longer than the worker's start on a loaded machine
    return 1.0


def test_scorer_counts_errors_and_timeouts():
    s = RewardScorer("test_data:_boom", max_error_rate=1.0)
    assert s(["x", "y"], ["1", "2"]) == [0.0, 0.0] and s.errors == 2 and "bad reward" in s.last_error
    s = RewardScorer("test_data:_nan", max_error_rate=1.0)
    assert s(["x"], ["1"]) == [0.0] and s.errors == 1
    s = RewardScorer("test_data:_slow", timeout=1.0, in_worker=True)
    t0 = time.time()
    assert s(["x"], ["1"]) == [0.0] and s.timeouts == 1
    assert time.time() - t0 < 300                    # the timeout ended it, not the 600 s sleep
    s.close()
    with pytest.raises(ValueError, match="exact_match, gsm8k, math_verify"):
        RewardScorer("nope")


def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv, deg = GroupMean()(r), degenerate_groups(r)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()   # unbiased: sqrt(1/3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert deg.tolist() == [False, True] and adv[1].abs().sum() == 0
    adv = GroupMean(normalize_std=False)(r)
    assert adv[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    # RLOO: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(RLOO()(r), torch.tensor([[2, -2, -2, 2], [0, 0, 0, 0]]) / 3.0)
    # a degenerate group of rewards whose float mean is not exactly theirs: 0, not rounding noise / eps
    flat = torch.full((1, 3), 0.9)                    # 0.9 - mean = 6e-8 in float32
    assert all(e(flat).abs().sum() == 0 for e in (GroupMean(), GroupMean(normalize_std=False), RLOO()))
    assert resolve_advantage("mean") == GroupMean(normalize_std=False) and resolve_advantage("rloo") == RLOO()
    with pytest.raises(ValueError, match="advantage='grpo' is not one of zscore, mean, rloo"):
        resolve_advantage("grpo")


def test_arithmetic_is_correct_and_distinct():
    src = Arithmetic(digits=2, ops="+-*", size=300, seed=1)
    assert len({e.prompt for e in src.examples}) == 300
    for e in src.examples:
        a, op, b = e.prompt[:-1].partition(next(c for c in "+-*" if c in e.prompt[1:]))
        assert str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]) == e.answer
    with pytest.raises(ValueError, match="ops"):
        Arithmetic(ops="/")


def test_local_jsonl_skips_and_counts_malformed_rows(tmp_path):
    rows = [{"question": "1+1=", "ans": "2"}, {"question": "2+2="}, {"ans": "5"},
            {"question": "", "ans": "0"}, {"question": "3+3=", "ans": 6}]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    src = HFPrompts(str(f), prompt_field="question", answer_field="ans", template="Q: {prompt}")
    assert [e.prompt for e in src.examples] == ["Q: 1+1=", "Q: 3+3="]
    assert [e.answer for e in src.examples] == ["2", "6"]
    assert src.skipped == 3
    with pytest.raises(ValueError, match="no usable rows"):
        HFPrompts(str(f), prompt_field="nope")


@pytest.fixture(scope="module")
def phase_dm(tiny_model_dir):
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=3, steps_per_rollout=2), sampling=SamplingConfig(max_new_tokens=5, seed=0),
                           source=Arithmetic(size=50))
    dm.setup("fit")
    return dm


def test_phase_batches_are_aligned(phase_dm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lit_ess.logprobs import sequence_logprobs

    batches = phase_dm.generate_phase()
    assert len(batches) == 2 and sum(b.input_ids.shape[0] for b in batches) == 12
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for b in batches:
        lp, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask)
        m = b.completion_mask
        assert (lp[m] - b.behavior_logprobs[m]).abs().max() < 1e-5      # on-policy, same alignment
        assert not (m & (b.attention_mask == 0)).any()
        assert b.stats["rollout/phase"] == phase_dm.buffer.next_phase - 1
        assert 0 <= b.stats["rollout/reward_mean"] <= 1


def test_state_dict_round_trip_continues_the_same_prompts(tiny_model_dir, phase_dm):
    phase_dm.generate_phase()
    state = phase_dm.state_dict()
    nxt = [e.prompt for _, e in phase_dm._next_examples(6)]
    fresh = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=50))
    fresh.load_state_dict(torch.load(_save(state), weights_only=False))
    assert [e.prompt for _, e in fresh._next_examples(6)] == nxt
    assert fresh.buffer.next_phase == phase_dm.buffer.next_phase


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


# ---------------------------------------------------------------- review defects (issue 6)


def _die_on(c, a):
    if c == "die":
        import os

        os._exit(3)                                  # a reward worker that crashes hard
    return 1.0


def _slow_on(c, a):
    if c == "slow":
        time.sleep(30)
    return 1.0


def test_math_verify_worker_start_is_not_charged_to_a_completion():
    """Starting the worker (sympy imports, ~2 s) must not count against a 1 s timeout."""
    s = RewardScorer("math_verify", timeout=1.0)
    try:
        assert s(["\\boxed{4}", "so 7", "\\boxed{\\frac{1}{2}}", "\\boxed{10}"], ["4", "7", "0.5", "10"]) == [1.0] * 4
        assert s.timeouts == 0 and s.errors == 0
    finally:
        s.close()


def test_a_timeout_does_not_make_the_next_completion_time_out():
    s = RewardScorer("test_data:_slow_on", timeout=1.0, in_worker=True)
    try:
        assert s(["slow", "ok", "ok"], ["1", "1", "1"]) == [0.0, 1.0, 1.0]
        assert s.timeouts == 1 and s.errors == 0
    finally:
        s.close()


def test_a_crashed_reward_worker_is_counted_and_replaced():
    s = RewardScorer("test_data:_die_on", timeout=10.0, in_worker=True)
    try:
        assert s(["ok", "die", "ok"], ["1", "1", "1"]) == [1.0, 0.0, 1.0]
        assert s.errors == 1 and "died" in s.last_error
    finally:
        s.close()


def _prompt_file(tmp_path, rows):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in rows))
    return str(f)


def test_drop_degenerate_keeps_a_row_for_every_step(tiny_model_dir, tmp_path):
    """4 prompts x 2 samples, 4 steps, 3 groups degenerate: 2 rows survive, so one dropped group is
    restored and every step gets a row."""
    src = HFPrompts(_prompt_file(tmp_path, [("1+1=", "const"), ("2+2=", "vary"), ("3+3=", "const"), ("4+4=", "const")]))
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=src, batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=2, steps_per_rollout=4), drop_degenerate=True,
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), reward="e2e_utils:varies_unless_const")
    dm.setup("fit")
    batches = dm.generate_phase()
    assert [b.input_ids.shape[0] for b in batches] == [1, 1, 1, 1]
    assert batches[0].stats["rollout/degenerate_frac"] == 0.75
    assert batches[0].stats["rollout/dropped_groups"] == 2.0
    assert sum(float(b.advantages.abs().sum()) for b in batches) > 0      # the informative group is kept


def test_long_prompts_skipped_over_many_phases_never_raise(tiny_model_dir, tmp_path):
    """10% of the prompts are too long: skipping them for 150 phases is fine (the counter used to be
    cumulative over the run and raised 'every prompt is longer' at phase ~125)."""
    rows = [(f"{i}+{i}=", str(2 * i)) for i in range(18)] + [("9" * 40 + "+1=", "x"), ("8" * 40 + "+1=", "y")]
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=HFPrompts(_prompt_file(tmp_path, rows)),
                           batch=BatchShape(prompts_per_rollout=8, samples_per_prompt=2), max_prompt_tokens=16,
                           sampling=SamplingConfig(max_new_tokens=1, seed=0))
    dm.setup("fit")
    for _ in range(150):
        dm.generate_phase()
    assert dm.skipped_long_prompts > 100                    # what used to trigger the false error
    state = dm.state_dict()
    assert state["skipped_long_prompts"] == dm.skipped_long_prompts


def test_all_prompts_too_long_is_named(tiny_model_dir, tmp_path):
    rows = [("9" * 40 + f"+{i}=", "x") for i in range(5)]
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=HFPrompts(_prompt_file(tmp_path, rows)),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), max_prompt_tokens=16,
                           sampling=SamplingConfig(max_new_tokens=1, seed=0))
    dm.setup("fit")
    with pytest.raises(ValueError, match="max_prompt_tokens=16"):
        dm.generate_phase()


def test_sft_prompts_use_the_chat_template_as_rl_does(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from lit_ess.datamodules import SFTDataModule

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}<|sep|>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|sep|>assistant: {% endif %}")
    folder = tmp_path / "chat"
    tok.save_pretrained(folder)
    src = Arithmetic(size=5)
    dm = SFTDataModule(model_path=str(folder), source=src)
    dm.setup("fit")
    for ex, (prompt_ids, _) in zip(src.examples, dm.items):
        want = tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                       tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert prompt_ids == list(want)


def test_reward_counters_survive_a_checkpoint(tiny_model_dir):
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=20),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), reward="test_data:_boom", reward_limits=RewardLimits(max_error_rate=1.0),
                           sampling=SamplingConfig(max_new_tokens=2, seed=0))
    dm.setup("fit")
    dm.generate_phase()
    assert dm.executor.worker.scorer.errors == 4
    fresh = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=20),
                              reward="test_data:_boom")
    fresh.load_state_dict(torch.load(_save(dm.state_dict()), weights_only=False))
    fresh.setup("fit")
    assert fresh.executor.worker.scorer.errors == 4


def test_arithmetic_splits_are_disjoint_whatever_the_digits_and_ops():
    """A fixed hash of the problem itself: no held-out sum appears in any training source, also one
    with other operators, another digit count, seed or size (the hash once mixed in digits and ops)."""
    test = {e.prompt for e in Arithmetic(digits=2, ops="+", size=1000, split="test").examples}
    assert 400 < len(test) < 600                                        # about 5% of the 10,000 sums
    for train in (Arithmetic(digits=2, ops="+", size=20000, split="train"),
                  Arithmetic(digits=2, ops="+-", size=20000, seed=3, split="train"),
                  Arithmetic(digits=1, ops="-+", size=500, split="train")):
        assert not test & {e.prompt for e in train.examples}
    one_digit = {e.prompt for e in Arithmetic(digits=1, ops="+", size=100, split="test").examples}
    assert one_digit <= {e.prompt for e in Arithmetic(digits=2, ops="+", size=10000, split="test").examples}
    big = Arithmetic(digits=4, ops="+", size=50, split="test")          # 10^8 problems: drawn, not listed
    assert len(big) == 50 and all(ex.answer == str(eval(ex.prompt[:-1])) for ex in big.examples)


def test_every_rank_gets_the_same_number_of_validation_batches():
    """Validation is collective (weight gather, metric sync): a rank without a batch would leave the
    others waiting. Each example is evaluated exactly once over all ranks."""
    from lit_ess.datamodules.rollout import val_chunks

    examples = list(range(10))
    for world in (1, 2, 3, 16):
        per_rank = [val_chunks(examples, 4, r, world) for r in range(world)]
        assert len({len(c) for c in per_rank}) == 1 and len(per_rank[0]) >= 1
        assert sorted(x for chunks in per_rank for chunk in chunks for x in chunk) == examples
        assert all(len(chunk) <= 4 for chunks in per_rank for chunk in chunks)


def test_held_out_evaluation_samples_with_val_sampling(tiny_model_dir):
    """validation.sampling changes the training settings for held-out prompts only (here: a shorter limit; the
    seed and the rest stay the training ones); an unknown setting is named."""
    held_out = [(i, f"{i}+{i}=", str(2 * i)) for i in range(4)]
    lengths = {}
    for name, val in (("train", None), ("val", {"max_new_tokens": 2})):
        dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=20),
                               sampling=SamplingConfig(max_new_tokens=6, seed=0), validation=Validation(samples=3, sampling=val, source=Arithmetic(size=8, split="test")))
        dm.setup("validate")
        lengths[name] = dm.evaluate(held_out).length
        assert val is None or (dm.val_sampling.seed, dm.val_sampling.max_new_tokens) == (0, 2)
        dm.teardown("validate")
    assert lengths["val"].shape == (4, 3) and lengths["val"].max() == 2
    assert lengths["train"].max() > 2                        # the random model rarely stops within 2 tokens
    with pytest.raises(ValueError, match=r"^data.validation.sampling: \['temp'\] are not sampling settings"):
        RolloutDataModule(model_path=tiny_model_dir, validation=Validation(sampling={"temp": 1.0}))
