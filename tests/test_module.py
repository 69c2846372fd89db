"""PolicyModule without a Trainer: the step's gradient does not depend on micro_batch_size."""
import pytest
import torch

from datamodules import Arithmetic, RolloutDataModule
from lit_ess.engines import SamplingConfig
from lit_ess.module import PolicyModule


@pytest.fixture(scope="module")
def stale_batch(tiny_model_dir):
    dm = RolloutDataModule(model_path=tiny_model_dir, engine="hf", prompts_per_rollout=4, samples_per_prompt=4,
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), source=Arithmetic(size=50),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    batch = dm.generate_phase()[0]
    g = torch.Generator().manual_seed(0)
    m = batch["completion_mask"]
    batch["behavior_logprobs"] = torch.where(m, batch["behavior_logprobs"] + 0.3 * torch.randn(m.shape, generator=g), 0.0)
    batch["advantages"] = torch.randn(m.shape[0], generator=g)        # non-degenerate, off-policy
    return batch


def grads(tiny_model_dir, batch, **kw):
    module = PolicyModule(tiny_model_dir, **kw)
    module.configure_model()
    metrics, ess = module.accumulate_gradients(batch)
    return torch.cat([p.grad.flatten() for p in module.policy.parameters()]), metrics, ess


@pytest.mark.parametrize("objective", ["p3o", "grpo", "gspo"])
def test_micro_batching_does_not_change_the_update(tiny_model_dir, stale_batch, objective):
    g_full, m_full, e_full = grads(tiny_model_dir, stale_batch, objective=objective)
    g_micro, m_micro, e_micro = grads(tiny_model_dir, stale_batch, objective=objective, micro_batch_size=3)
    assert torch.allclose(g_full, g_micro, atol=1e-6, rtol=1e-4)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], abs=1e-5)
    if objective == "p3o":
        assert 0 < float(e_full) < 0.99 and float(e_micro) == pytest.approx(float(e_full), rel=1e-6)


def test_micro_scope_reproduces_per_micro_batch_ess(tiny_model_dir, stale_batch):
    g_step, *_ = grads(tiny_model_dir, stale_batch, micro_batch_size=3)
    g_micro, *_ = grads(tiny_model_dir, stale_batch, micro_batch_size=3, ess_scope="micro")
    assert not torch.allclose(g_step, g_micro, atol=1e-6)     # the reference's per-micro-batch ESS differs


def test_bad_module_settings_are_named(tiny_model_dir):
    with pytest.raises(ValueError, match="ess_scope"):
        PolicyModule(tiny_model_dir, ess_scope="global")
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        PolicyModule(tiny_model_dir, objective="ppo")


def test_entropy_bonus_and_reference_kl_run_through_the_module(tiny_model_dir, stale_batch):
    g0, m0, _ = grads(tiny_model_dir, stale_batch)
    g1, m1, _ = grads(tiny_model_dir, stale_batch, objective_kwargs={"entropy_coef": 0.01, "ref_kl_coef": 0.1})
    assert m1["entropy"] > 0 and m1["kl_ref"] == pytest.approx(0.0, abs=1e-6)   # reference = the start policy
    assert torch.isfinite(g1).all() and not torch.allclose(g0, g1)
