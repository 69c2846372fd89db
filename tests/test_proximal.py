"""Proximal logprobs (issue 18, item 1): the trainer's own old logprobs, scored once per rollout phase with
the weights of the step that starts it, in the gradient pass's own micro-batches."""
from dataclasses import replace

import lightning as L
import pytest
import torch

from lit_ess.callbacks import WeightSync
from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.logprobs import sequence_logprobs
from lit_ess.lora import LoRA
from lit_ess.module import PolicyModule
from lit_ess.objectives import GRPO, DecoupledPPO
from lit_ess.rollout import RolloutBuffer
from lit_ess.batch import Proximal
from lit_ess.datamodules.settings import BatchShape, Schedule
from lit_ess.settings import MicroBatch, Optim


def data(model_dir, k=2, **kw):
    return RolloutDataModule(model_path=model_dir, engine=HFConfig(), source=Arithmetic(size=200), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=4, steps_per_rollout=k), sampling=SamplingConfig(max_new_tokens=6, seed=0),
                             reward="e2e_utils:digit_fraction", **kw)


@pytest.fixture(scope="module")
def phase(tiny_model_dir):
    dm = data(tiny_model_dir)
    dm.setup("fit")
    return dm.generate_phase()                    # 2 batches of 8 rows, sampled with the initial weights


class Recording(DecoupledPPO):
    """DecoupledPPO that keeps the logprobs and proximal logprobs of every call."""

    def __call__(self, logprobs, *args, proximal_logprobs=None, **kwargs):
        self.__dict__.setdefault("seen", []).append((logprobs.detach().clone(), proximal_logprobs))
        return super().__call__(logprobs, *args, proximal_logprobs=proximal_logprobs, **kwargs)


@pytest.mark.parametrize("lora", [None, LoRA(rank=4)], ids=["full", "lora"])
def test_the_first_batch_of_a_phase_scores_exactly_its_own_gradient_pass(tiny_model_dir, phase, lora):
    """score_proximal in micro-batches of 3 rows (3 + 3 + 2) at train temperature 0.7 gives, for the batch
    trained at the phase's first step, exactly the lp.detach() of its gradient pass: the same forward
    (with LoRA: adapters on, here non-zero). score_phase's shortcut (mark that batch, score only the
    waiting ones) therefore gives the identical update."""
    grads = []
    for scored in (True, False):
        m = PolicyModule(tiny_model_dir, objective=Recording(), micro_batch=MicroBatch(size=3), lora=lora, train_temperature=0.7)
        torch.manual_seed(0)                       # the same adapters in both modules
        m.configure_model()
        if lora is not None:
            for n, p in m.policy.named_parameters():
                if "lora_B" in n:
                    p.data.normal_(0, 0.5)
        b0, b1 = (replace(b) for b in phase)
        if scored:
            m.score_proximal([b0, b1], pad=b0)
            assert b0.proximal == b1.proximal == Proximal(0, "scored") and b1.prox_logprobs.shape == b1.behavior_logprobs.shape
        else:
            b0.proximal = Proximal(0, "own_pass")  # what score_phase does for the batch it is about to train
        m.accumulate_gradients(b0)
        assert len(m.objective.seen) == 3
        for lp, prox in m.objective.seen:
            assert torch.equal(prox, lp)
        grads.append(torch.cat([p.grad.flatten() for p in m.policy.parameters() if p.grad is not None]))
    assert torch.equal(*grads)


def test_an_objective_that_needs_them_names_what_is_missing(tiny_model_dir, phase):
    """A direct call with a batch no step has scored, and a step with no data side to take the phase's
    waiting batches from, are named in one line."""
    m = PolicyModule(tiny_model_dir, objective=GRPO(old="proximal"))
    m.configure_model()
    with pytest.raises(ValueError, match=r"^objective GRPO uses the trainer's proximal logprobs, which training_step "
                                         r"scores .*: this batch has none \(batch.proximal is None\)$"):
        m.accumulate_gradients(replace(phase[0]))
    with pytest.raises(ValueError, match=r"objective GRPO .*: no data module attached its phases \(attach_rollouts\)$"):
        m.score_phase(replace(phase[0]))


def test_select_and_the_buffer_state_keep_them(phase):
    b = replace(phase[1], prox_logprobs=torch.randn(phase[1].behavior_logprobs.shape), proximal=Proximal(7, "scored"))
    part = b.select([1, 3])
    width = part.input_ids.shape[1]
    assert torch.equal(part.prox_logprobs, b.prox_logprobs[[1, 3], :width]) and part.proximal == Proximal(7, "scored")
    buf = RolloutBuffer(2, 1)
    buf.put(0, [replace(phase[0]), b])
    buf.take(0)
    again = RolloutBuffer(2, 1)
    again.load_state_dict(buf.state_dict())            # a mid-phase checkpoint
    (kept,) = again.waiting(0)
    assert torch.equal(kept.prox_logprobs, b.prox_logprobs) and kept.proximal == Proximal(7, "scored")


def fit(model_dir, module, callbacks, steps, k=2, **data_kw):
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(module, data(model_dir, k, **data_kw))
    return trainer


class CheckProximal(L.Callback):
    """At a phase's first step, keep the weights before the step and check, after it, that the batch was
    marked and the waiting one scored; at the second step, score its rows with the kept weights."""

    def __init__(self):
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch.index == 0:
            step = trainer.global_step - 1                    # the step just taken
            assert batch.proximal == Proximal(step, "own_pass") and batch.prox_logprobs is None
            (waiting,) = pl_module.rollouts.waiting_batches(batch.phase)
            assert waiting.proximal == Proximal(step, "scored") and waiting.prox_logprobs is not None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if batch.index == 0:
            assert batch.proximal is None
            self.weights = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}
            return
        from transformers import AutoModelForCausalLM

        start = AutoModelForCausalLM.from_pretrained(pl_module.hparams.model_path)
        start.load_state_dict(self.weights)
        m = batch.completion_mask
        want, _ = sequence_logprobs(start.eval(), batch.input_ids, batch.attention_mask, m)
        now, _ = sequence_logprobs(pl_module.policy, batch.input_ids, batch.attention_mask, m)
        assert batch.proximal == Proximal(step - 1, "scored")
        assert torch.allclose(batch.prox_logprobs[m], want[m], atol=1e-5)
        assert (now[m] - want[m]).abs().max() > 1e-3                     # the first step really moved the policy
        self.checked += 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_run_scores_each_phase_with_its_first_steps_weights(tiny_model_dir, mode):
    """A plain Trainer, 2 steps per rollout, DecoupledPPO in micro-batches of 3, no callback for it: the
    second batch of each phase carries the logprobs of the weights that trained the first, not the current
    ones (async: the worker process generates ahead, max_staleness 2, and the buffer's waiting batches are
    scored alike)."""
    check = CheckProximal()
    module = PolicyModule(tiny_model_dir, objective=DecoupledPPO(), micro_batch=MicroBatch(size=3), optim=Optim(lr=1e-2))
    extra = {"schedule": Schedule(mode="async", max_staleness=2)} if mode == "async" else {}
    fit(tiny_model_dir, module, [WeightSync(), check], steps=4, **extra)
    assert check.checked == 2


def test_p3o_anchor_on_rows_older_than_their_proximal_policy_warns_once(tiny_model_dir, phase):
    """P3O's kl_anchor stands for the behaviour weights at the train temperature; rows sampled before the
    phase's first step (async, or max_staleness > k - 1) get the newer proximal policy instead: said once."""
    import warnings

    from lit_ess.objectives import P3O

    m = PolicyModule(tiny_model_dir, objective=P3O(kl_anchor="behavior_at_train_temperature"))
    m.configure_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # rows of the proximal step itself: silent
        m.accumulate_gradients(replace(phase[0], proximal=Proximal(0, "own_pass")))
    with pytest.warns(UserWarning, match=r"rows sampled by the weights of step 0 are anchored at the proximal "
                                         r"policy of step 2 \(P3O\.kl_anchor: behavior_at_train_temperature\)"):
        m.accumulate_gradients(replace(phase[0], proximal=Proximal(2, "own_pass")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # once
        m.accumulate_gradients(replace(phase[0], proximal=Proximal(2, "own_pass")))


class Recorded(L.pytorch.loggers.Logger):
    """A logger that keeps every (step, key) it is given."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, str]] = []

    name, version = "recorded", 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.seen += [(step, k) for k in metrics]


def test_proximal_seconds_are_logged_at_every_phase_start_whatever_log_every_n_steps(tiny_model_dir):
    """perf/proximal_seconds is written on the steps that start a phase (x = the step after its update),
    also when log_every_n_steps skips those steps (2 steps per rollout, log_every_n_steps 2: the phases
    start at x = 1 and 3, the step metrics are written at x = 2 and 4)."""
    rec = Recorded()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=rec, log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[WeightSync()])
    trainer.fit(PolicyModule(tiny_model_dir, objective=DecoupledPPO()), data(tiny_model_dir, 2))
    assert [s for s, k in rec.seen if k == "perf/proximal_seconds"] == [1, 3]
    assert [s for s, k in rec.seen if k == "train/loss"] == [2, 4]
