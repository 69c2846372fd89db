"""PolicyModule without a Trainer: the step's gradient does not depend on micro_batch_size."""
from dataclasses import replace

import lightning as L
import pytest
import torch

from e2e_utils import sampled_batch
from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.module import PolicyModule
from lit_ess.objectives import GRPO, GSPO, P3O
from lit_ess.datamodules.settings import BatchShape
from lit_ess.settings import Compute, MicroBatch, Optim


@pytest.fixture(scope="module")
def stale_batch(tiny_model_dir):
    batch = sampled_batch(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    m = batch.completion_mask
    batch.behavior_logprobs = torch.where(m, batch.behavior_logprobs + 0.3 * torch.randn(m.shape, generator=g), 0.0)
    batch.advantages = torch.randn(m.shape[0], generator=g)        # non-degenerate, off-policy
    return batch


def grads(tiny_model_dir, batch, objective=P3O, objective_kwargs=None, **kw):
    module = PolicyModule(tiny_model_dir, objective=objective(**(objective_kwargs or {})), **kw)
    module.configure_model()
    metrics, ess = module.accumulate_gradients(batch)
    return torch.cat([p.grad.flatten() for p in module.policy.parameters()]), metrics, ess


@pytest.mark.parametrize("objective", [P3O, GRPO, GSPO], ids=lambda c: c.__name__)
def test_micro_batching_does_not_change_the_update(tiny_model_dir, stale_batch, objective):
    g_full, m_full, e_full = grads(tiny_model_dir, stale_batch, objective=objective)
    g_micro, m_micro, e_micro = grads(tiny_model_dir, stale_batch, objective=objective, micro_batch=MicroBatch(size=3))
    assert torch.allclose(g_full, g_micro, atol=1e-6, rtol=1e-4)
    assert m_micro["train/loss"] == pytest.approx(m_full["train/loss"], abs=1e-5)
    if objective is P3O:
        assert 0 < float(e_full) < 0.99 and float(e_micro) == pytest.approx(float(e_full), rel=1e-6)


def test_micro_scope_reproduces_per_micro_batch_ess(tiny_model_dir, stale_batch):
    g_step, *_ = grads(tiny_model_dir, stale_batch, micro_batch=MicroBatch(size=3))
    g_micro, *_ = grads(tiny_model_dir, stale_batch, micro_batch=MicroBatch(size=3), ess_scope="micro")
    assert not torch.allclose(g_step, g_micro, atol=1e-6)     # the reference's per-micro-batch ESS differs


def test_bad_module_settings_are_named(tiny_model_dir):
    with pytest.raises(ValueError, match="ess_scope"):
        PolicyModule(tiny_model_dir, ess_scope="global")
    with pytest.raises(ValueError, match="objective must be an Objective"):
        PolicyModule(tiny_model_dir, objective="p3o")


def test_entropy_bonus_and_reference_kl_run_through_the_module(tiny_model_dir, stale_batch):
    g0, m0, _ = grads(tiny_model_dir, stale_batch)
    g1, m1, _ = grads(tiny_model_dir, stale_batch, objective_kwargs={"entropy_coef": 0.01, "ref_kl_coef": 0.1})
    assert m1["train/entropy"] > 0 and m1["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)   # reference = the start policy
    assert torch.isfinite(g1).all() and not torch.allclose(g0, g1)


# ---------------------------------------------------------------- review defects (issue 6)


def _with_sampling(batch, **sampling):
    return replace(batch, sampling=replace(batch.sampling, **sampling))


@pytest.mark.parametrize("sampling, train_temperature", [
    ({"top_k": 20, "top_p": 0.7}, None),
    ({}, 0.7),
    ({"top_k": 20, "top_p": 0.7, "temperature": 1.3}, 0.7),
], ids=["topk-topp", "train-T", "all"])
def test_reference_kl_is_zero_when_reference_is_policy(tiny_model_dir, stale_batch, sampling, train_temperature):
    """The reference is scored exactly as the policy (temperature, train_temperature, top-k, top-p)."""
    batch = _with_sampling(stale_batch, **sampling)
    _, m, _ = grads(tiny_model_dir, batch, objective_kwargs={"ref_kl_coef": 0.1},
                    train_temperature=train_temperature)
    assert m["train/kl_ref"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("objective", [P3O, GRPO], ids=lambda c: c.__name__)
def test_dr_grpo_normalisation_is_a_constant(tiny_model_dir, stale_batch, objective):
    """seq-mean-token-sum-norm divides by max_new_tokens, not by a micro-batch's padded width."""
    kw = {"objective": objective, "objective_kwargs": {"aggregation": "seq-mean-token-sum-norm"}}
    ends = stale_batch.attention_mask.sum(-1)     # rows 0 and 1 end 2 tokens early: a narrower micro-batch
    assert (stale_batch.completion_mask[:2].sum(-1) > 2).all()
    masks = {k: getattr(stale_batch, k).clone() for k in ("attention_mask", "completion_mask")}
    for k in masks:
        for r in (0, 1):
            masks[k][r, int(ends[r]) - 2:] = 0
    stale_batch = replace(stale_batch, **masks)
    g_full, m_full, _ = grads(tiny_model_dir, stale_batch, **kw)
    g_micro, m_micro, _ = grads(tiny_model_dir, stale_batch, micro_batch=MicroBatch(size=2), **kw)
    assert m_micro["train/loss"] == pytest.approx(m_full["train/loss"], rel=1e-5, abs=1e-8)
    assert torch.allclose(g_full, g_micro, atol=1e-6, rtol=1e-4)
    if objective is GRPO:     # hand-computed: sum of clipped surrogates / (N_seqs * max_new_tokens)
        from transformers import AutoModelForCausalLM

        from lit_ess.logprobs import sequence_logprobs

        b = stale_batch
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        lp, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask)
        m = b.completion_mask
        rho = (lp - b.behavior_logprobs).exp()
        adv = b.advantages[:, None]
        surr = torch.minimum(rho * adv, rho.clamp(0.8, 1.2) * adv)
        want = -(surr * m).sum() / ((m.sum(-1) > 0).sum() * b.sampling.max_new_tokens)
        assert m_full["train/policy_loss"] == pytest.approx(float(want.detach()), rel=1e-5)


def test_step_ess_does_not_depend_on_micro_batching_with_tokens_outside_top_k(tiny_model_dir, stale_batch):
    """Tokens sampled outside the trainer's top-k set have trainer logprob -inf: one masking rule
    (drop them from the loss and the ESS) in the pre-pass and in the single pass."""
    batch = _with_sampling(stale_batch, top_k=3)
    _, m_full, e_full = grads(tiny_model_dir, batch)
    _, m_micro, e_micro = grads(tiny_model_dir, batch, micro_batch=MicroBatch(size=2))
    assert m_full["train/nonfinite_tokens"] > 0                     # the case is really exercised
    assert float(e_micro) == pytest.approx(float(e_full), rel=1e-6)
    assert m_micro["train/loss"] == pytest.approx(m_full["train/loss"], abs=1e-6)


def test_nan_trainer_logprob_gives_a_finite_step_ess(tiny_model_dir, stale_batch):
    """A NaN in the trainer's logprobs (here: row 0's embeddings) is masked in the pre-pass as in the
    single pass: the step ESS is finite and the same with and without micro-batches."""
    row0 = stale_batch.input_ids[0]

    def poison_row0(embedding, inputs, out):            # NaN embeddings for the row equal to row 0
        ids = inputs[0]
        is_row0 = (ids == row0[: ids.shape[1]]).all(-1)
        return torch.where(is_row0[:, None, None], torch.full_like(out, float("nan")), out)

    results = []
    for micro in (None, 2):
        module = PolicyModule(tiny_model_dir, micro_batch=MicroBatch(size=micro))
        module.configure_model()
        module.policy.get_input_embeddings().register_forward_hook(poison_row0)
        results.append(module.accumulate_gradients(stale_batch))
    (m_full, ess_full), (m_micro, ess_micro) = results
    assert m_full["train/nonfinite_tokens"] == int(stale_batch.completion_mask[0].sum())
    assert torch.isfinite(ess_micro) and float(ess_micro) == pytest.approx(float(ess_full), rel=1e-6)


@pytest.fixture(scope="module")
def dropout_model_dir(tmp_path_factory):
    from lit_ess.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("dropout") / "model", attention_dropout=0.5))


def test_dropout_is_off_in_the_trainer(dropout_model_dir):
    """A model with attention dropout 0.5: on-policy data (hf engine, eval) must give ESS 1."""
    dm = RolloutDataModule(model_path=dropout_model_dir, engine=HFConfig(), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=4),
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), source=Arithmetic(size=50),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    batch = dm.generate_phase()[0]
    batch.advantages = torch.randn(batch.input_ids.shape[0], generator=torch.Generator().manual_seed(0))
    _, m, ess = grads(dropout_model_dir, batch, micro_batch=MicroBatch(size=4))
    assert float(ess) >= 0.99999 and m["train/ratio_max"] < 1.0001
    _, _, ess_on = grads(dropout_model_dir, batch, micro_batch=MicroBatch(size=4), compute=Compute(disable_dropout=False))
    assert float(ess_on) < 0.999                              # the knob is real: dropout on breaks ESS 1


def test_skipped_steps_survive_a_checkpoint(tiny_model_dir):
    module = PolicyModule(tiny_model_dir)
    module.skipped_steps = 3
    ckpt = {}
    module.on_save_checkpoint(ckpt)
    fresh = PolicyModule(tiny_model_dir)
    fresh.on_load_checkpoint(ckpt)
    assert fresh.skipped_steps == 3


def test_plain_trainer_resumes_with_a_typed_objective(tiny_model_dir, tmp_path):
    """Without the CLI the objective dataclass is pickled in the checkpoint's hparams; torch.load's
    weights_only default must accept it (regression: 'Unsupported global: lit_ess.objectives.GRPO')."""
    from lit_ess.callbacks import WeightSync
    from lit_ess.objectives import GRPO

    def fit(steps, ckpt=None):
        module = PolicyModule(tiny_model_dir, objective=GRPO(clip_eps=0.3))
        dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=50),
                               batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=2), sampling=SamplingConfig(max_new_tokens=4, seed=0))
        saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
        trainer = L.Trainer(accelerator="cpu", max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False,
                            callbacks=[WeightSync(), saver])
        trainer.fit(module, dm, ckpt_path=ckpt)
        return trainer, module

    fit(2)
    trainer, module = fit(3, str(tmp_path / "last.ckpt"))
    assert trainer.global_step == 3 and module.objective == GRPO(clip_eps=0.3)


class _Recorder(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step - 1, batch.versions.tolist(), batch.prompt_ids.tolist()))


@pytest.mark.parametrize("k", [1, 2])
def test_plain_trainer_needs_no_flag_and_never_reuses_a_rollout(tiny_model_dir, k):
    """A plain Trainer (no reload_dataloaders_every_n_epochs): every phase is new data generated with
    the weights of its first step, and the full weights are pushed once per phase, not per step."""
    from lit_ess.callbacks import WeightSync

    rec, sync = _Recorder(), WeightSync()
    module = PolicyModule(tiny_model_dir, optim=Optim(lr=1e-3))
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=200),
                           batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=2, steps_per_rollout=k),
                           sampling=SamplingConfig(max_new_tokens=4, seed=0))
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[sync, rec])
    trainer.fit(module, dm)
    assert [s for s, _, _ in rec.steps] == list(range(6))
    for step, versions, _ in rec.steps:
        assert set(versions) == {step - step % k}                 # the weights of the phase's first step
    phases = [sorted(p for _, _, ids in rec.steps[i:i + k] for p in ids) for i in range(0, 6, k)]
    assert len({tuple(p) for p in phases}) == 6 // k               # no rollout trained twice
    assert sync.pushes == 6 // k                                   # at start, then once per new phase
