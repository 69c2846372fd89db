"""The lag-0 ESS alarm (issue 18, item 6): when it applies, once-only warning, the count, the error switch."""
from dataclasses import replace

import pytest

from lit_ess.engines import HFConfig, VLLMConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.health import ESSWatch, StepFacts, exact_on_policy
from lit_ess.settings import Compute, ESSAlarm

EXACT = StepFacts(lag_max=0, engine_dtype="float32", precision="32-true", model_dtype="float32", cast_dtype=None,
                  lora=False, dropout=False, sample_temperature=1.0, train_temperature=1.0)


def test_it_applies_only_where_the_ess_must_be_one():
    assert exact_on_policy(EXACT)
    assert not exact_on_policy(replace(EXACT, lag_max=1))                                  # lag 1: stale rows
    assert not exact_on_policy(replace(EXACT, engine_dtype="bfloat16"))                    # precision mismatch
    assert not exact_on_policy(replace(EXACT, engine_dtype=None))                          # the engine does not say
    assert not exact_on_policy(replace(EXACT, sample_temperature=1.5))                     # temperature mismatch
    assert not exact_on_policy(replace(EXACT, dropout=True))                               # random masks
    assert ESSWatch(ESSAlarm(None)).check(1, 0.1, 0.01, EXACT) is None                               # off


def test_warns_once_with_the_numbers_and_counts_every_step():
    a = ESSWatch(ESSAlarm(0.999))
    assert a.check(3, 0.9995, 1.0, EXACT) is None and a.count == 0
    first = a.check(4, 0.0213, 3e-7, EXACT)
    assert first.startswith("step 4: ESS 0.021300 (mean ratio pi_theta/pi_b 3e-07) below model.ess_alarm.threshold=0.999")
    assert "check the weight sync" in first and "\n" not in first
    assert a.check(5, 0.5, 0.4, EXACT) is None and a.count == 2                    # counted, not warned again
    assert a.check(6, 0.5, 0.4, replace(EXACT, lag_max=2)) is None and a.count == 2  # lag 2: not a fault


def test_the_switch_makes_it_an_error():
    with pytest.raises(RuntimeError, match=r"^step 1: ESS 0\.100000 .*\(check the weight sync\)$"):
        ESSWatch(ESSAlarm(0.999, error=True)).check(1, 0.1, 0.01, EXACT)
    with pytest.raises(ValueError, match=r"^model.ess_alarm.threshold must be in"):
        ESSAlarm(1.5)


def test_engines_say_when_their_logprobs_are_the_trainers():
    assert VLLMConfig().exact_dtype() == "float32" and VLLMConfig(dtype="bfloat16").exact_dtype() == "bfloat16"
    assert VLLMConfig(behavior_logprobs="raw").exact_dtype() is None
    assert VLLMConfig(vllm_kwargs={"quantization": "fp8"}).exact_dtype() is None
    assert VLLMConfig(vllm_kwargs={"kv_cache_dtype": "fp8"}).exact_dtype() is None
    assert VLLMConfig(dtype="auto").exact_dtype() is None
    assert HFConfig().exact_dtype() == "float32" and HFConfig(behavior_logprobs="raw").exact_dtype() is None


def test_the_trainers_dtype_follows_precision_and_fsdp2s_cast(tiny_model_dir):
    from types import SimpleNamespace

    from lit_ess.module import PolicyModule

    m = PolicyModule(tiny_model_dir, compute=Compute(dtype="bfloat16"))
    m.configure_model()

    def trainer_dtype():
        return m.step_facts(SamplingConfig(), "bfloat16", 0.0).trainer_dtype

    assert trainer_dtype() == "bfloat16"                             # no Trainer: "32-true", the stored dtype
    for precision, want in (("32-true", "bfloat16"), ("bf16-true", "bfloat16"), ("bf16-mixed", None), ("16-mixed", None)):
        m._trainer = SimpleNamespace(precision=precision)
        assert trainer_dtype() == want, precision
    m._trainer = SimpleNamespace(precision="32-true")
    m.cast_forward("float16")                                       # FSDP2 param_dtype float16
    assert trainer_dtype() == "float16"


def test_dropout_or_fp32_adapters_on_a_16_bit_base_are_not_exact(tiny_model_dir):
    """A healthy lag-0 step under LoRA dropout (random masks) or with peft's fp32 adapters on a bf16 base
    has ESS below 1: not counted, not warned (it was, and with ess_alarm.error stopped a healthy run)."""
    from lit_ess.lora import LoRA
    from lit_ess.module import PolicyModule

    logs = {"train/ess": 0.99, "train/ratio_mean": 1.0, "train/policy_lag_max": 0.0}
    for kw, exact in (({}, True), ({"lora": LoRA(rank=4)}, True), ({"lora": LoRA(rank=4, dropout=0.1)}, False),
                      ({"lora": LoRA(rank=4), "compute": Compute(dtype="bfloat16")}, False)):
        m = PolicyModule(tiny_model_dir, ess_alarm=ESSAlarm(error=True), **kw)
        m.configure_model()
        facts = m.step_facts(SamplingConfig(temperature=1.0), m.compute.dtype, 0.0)
        if exact:
            with pytest.raises(RuntimeError, match="below model.ess_alarm.threshold=0.999"):
                m._check_ess(dict(logs), facts, step=1)
        else:
            out = dict(logs)
            m._check_ess(out, facts, step=1)
            assert out["train/ess_alarms"] == 0.0, kw


@pytest.mark.parametrize("precision, model_dtype, cast, lora, engine, exact", [
    ("bf16-true", "float32", None, False, "bfloat16", True),          # the whole forward in bf16, a bf16 engine
    ("bf16-true", "float32", None, False, "float32", False),          # a bf16 trainer against an fp32 engine
    ("bf16-mixed", "float32", None, False, "bfloat16", False),        # autocast mixes dtypes: never exact
    ("bf16-mixed", "float32", None, False, "float32", False),
    ("32-true", "float32", "bfloat16", False, "bfloat16", True),      # FSDP2 param_dtype bf16
    ("32-true", "float32", "bfloat16", False, "float32", False),
    ("32-true", "bfloat16", None, False, "bfloat16", True),           # stored in bf16, no cast
    ("32-true", "bfloat16", None, True, "bfloat16", False),           # LoRA's fp32 adapters on a bf16 base
    ("bf16-true", "float32", None, True, "bfloat16", False),          # LoRA under bf16-true
    ("32-true", "float32", "bfloat16", True, "bfloat16", False),      # LoRA under FSDP2's bf16 cast
    ("32-true", "float32", None, True, "float32", True),              # LoRA on an fp32 base, fp32 engine
])
def test_the_alarm_table_for_bf16_fsdp2_and_lora(precision, model_dtype, cast, lora, engine, exact):
    """Whether a lag-0 step's ESS must be 1 for each precision set-up users run (the same decisions as
    the trainer-dtype and ESSAlarm.applies logic before `exact_on_policy`, checked case by case)."""
    facts = replace(EXACT, precision=precision, model_dtype=model_dtype, cast_dtype=cast, lora=lora, engine_dtype=engine)
    assert exact_on_policy(facts) is exact
