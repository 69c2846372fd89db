"""PolicyModule: the policy, the objective and one optimizer step per `training_step`.

Manual optimization: a step's batch (one `RolloutBatch`) is split into micro-batches, each
is forwarded and back-propagated, then gradients are clipped and the optimizer steps once. Token-mean
losses are normalised by the token count of the *whole step* (all micro-batches, all ranks), so the
update does not depend on how the step is cut (`micro_batch.size` or `micro_batch.tokens`).

The ESS of P3O is taken over the whole step as well (`ess_scope: step`): with several micro-batches a
no-grad pre-pass collects its statistics first (for P4O those of pi_theta / pi_prox too).
`ess_scope: micro` reproduces the authors' reference, which computes it per micro-batch. Every objective
logs the step's ESS (`train/ess`), as a diagnostic of how off-policy its data was; P3O and P4O use it in
the loss.

Data parallel (W ranks, DDP or FSDP2): each rank holds its share of the step's rows. Losses are
normalised by the global counts, and DDP/FSDP *average* gradients over ranks, so each rank's loss is
scaled by W before backward: the update and `train/grad_norm` equal those of one rank with the whole
batch. Ranks run the same number of forward/backward passes (a rank with fewer micro-batches runs
zero-weighted extra passes), since every pass under FSDP is a collective. Every logged metric is
combined over micro-batches and ranks by its rule in lit_ess.metrics.RULES (sum, token-weighted mean,
mean over ranks, min, max, pooled std).

Proximal logprobs (log pi_prox, the policy's own with the weights that start a rollout phase), when the
objective uses them (`objective.needs_proximal`): `score_phase` scores the phase's waiting batches once,
no grad, when its first batch is trained; that batch uses its own gradient pass's lp.detach() (same
weights, same forward). The waiting batches come from the data side (lit_ess.data.RolloutData), which
RolloutDataModule hands over at setup (`attach_rollouts`).

Health check (`ess_alarm`, lit_ess.settings.ESSAlarm): a step at policy lag 0 whose engine samples at the trainer's precision and
temperature must have ESS 1; below the threshold it warns once and counts (lit_ess/health.py, which
decides from the facts the step declares: `step_facts`).
"""
from __future__ import annotations

import time
from typing import Iterator, Literal, NamedTuple

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from .batch import EvalResult, Proximal, RolloutBatch
from .data import RolloutData
from .health import ESSWatch, NonFiniteError, SkippedSteps, StepFacts, first_nonfinite
from .knobs import check
from .logprobs import check_chunked_head, sequence_logprobs
from .lora import LoRA, adapter_state, adapter_weights, base_fingerprint, is_adapter_key, merged_weights
from .metrics import PassAtK, accumulate, finish_token_means, reduce_over_ranks
from .model_path import check_model_path
from .objectives import P3O, ESSStats, Objective, ess_stats, ratio_metrics
from .packing import check_packed_forward, packed_logprobs, plan_micro_batches, plan_ranks
from .sampling import SamplingConfig
from .settings import Compute, ESSAlarm, MicroBatch, Optim
from .step import build_optimizer, clip_gradients, disable_dropout, finite_mask, full_weights, has_dropout, lr_factor

PACKED_ATTENTION = {"sdpa", "eager", "flash_attention_2", "flash_attention_3"}   # model.micro_batch.packing's attention

__all__ = ["PolicyModule", "StepCounts", "full_weights", "full_state_dict", "disable_dropout"]


class StepCounts(NamedTuple):
    """Counts of one optimizer step, float64 scalars."""
    tokens: Tensor          # N: completion tokens of all micro-batches on all ranks
    seqs: Tensor            # rows with at least one completion token, all ranks
    local_tokens: Tensor    # n_r: this rank's completion tokens


class PolicyModule(L.LightningModule):
    """The policy, the objective and one optimizer step per `training_step`.

    Args:
        model_path: Hugging Face causal LM folder or name.
        objective: the objective and its hyper-parameters, a class of lit_ess.objectives: P3O (default),
            P4O, GRPO, DAPO, GSPO, CISPO, DecoupledPPO, REINFORCE. ref_kl_coef > 0 loads a frozen reference.
        ref_model_path: reference model for ref_kl_coef; default model_path.
        optim: AdamW and its schedule (lit_ess.settings.Optim: lr, weight_decay, betas, warmup_steps,
            lr_schedule, min_lr_ratio, max_grad_norm).
        max_consecutive_skipped_steps: stop the run (one line, exit 1) after this many consecutive skipped
            steps (>= 1). A transient overflow skips a step or two; ten in a row with finite weights is a
            run that no longer learns. Non-finite weights stop the run at once, naming the tensor: they are
            checked when the run starts (policy, reference, a resumed checkpoint's) and at a skipped step.
        micro_batch: how a step is cut into forward/backward passes (lit_ess.settings.MicroBatch: size,
            tokens, packing); the update is the same however it is cut.
        ess_scope: "step" (ESS over all micro-batches and ranks) or "micro" (per micro-batch).
        train_temperature: temperature of the trainer's log-probs, > 0; None = the rollout's (on-policy).
        compute: the policy's dtype and its forward's memory trade-offs (lit_ess.settings.Compute: dtype,
            gradient_checkpointing, logprob_chunk, disable_dropout).
        lora: low-rank adapters (lit_ess.lora.LoRA: rank, alpha, dropout, target_modules) trained on a
            frozen base; None = full fine-tuning. The engine receives the merged weights (lora.sync: merged)
            or the adapters alone (lora.sync: adapter, vLLM serving them); checkpoints hold the adapters
            and their optimizer state only. With ref_kl_coef > 0 and no
            ref_model_path, the reference is the base model (the adapters switched off): no second copy.
        ess_alarm: the lag-0 ESS health check of the weight sync (lit_ess.settings.ESSAlarm: threshold, error).
    """

    # knobs a resume may change (the CLI refuses a resume whose other knobs differ from the checkpoint's):
    # how a step is split in memory, and the alarms; what a step computes stays the checkpoint's run's. `lora`
    # is judged by check_checkpoint_settings (its shape must match; `sync` is only how weights travel)
    RESUME_FREE = frozenset({"micro_batch", "compute.gradient_checkpointing", "compute.logprob_chunk", "ess_alarm",
                             "max_consecutive_skipped_steps", "lora"})

    def __init__(
        self,
        model_path: str,
        objective: Objective = P3O(),
        ref_model_path: str | None = None,
        optim: Optim = Optim(),
        micro_batch: MicroBatch = MicroBatch(),
        ess_scope: Literal["step", "micro"] = "step",
        train_temperature: float | None = None,
        compute: Compute = Compute(),
        lora: LoRA | None = None,
        ess_alarm: ESSAlarm = ESSAlarm(),
        max_consecutive_skipped_steps: int = 10,
    ):
        super().__init__()
        for name, group, kind in (("optim", optim, Optim), ("micro_batch", micro_batch, MicroBatch),
                                  ("compute", compute, Compute), ("ess_alarm", ess_alarm, ESSAlarm)):
            if not isinstance(group, kind):
                raise ValueError(f"model.{name} must be a lit_ess.settings.{kind.__name__}, got {group!r}")
        check("model.train_temperature", train_temperature, gt=0, null=True)
        self.save_hyperparameters()
        check_model_path(model_path)
        if ref_model_path is not None:
            check_model_path(ref_model_path, "ref_model_path")
        if ess_scope not in ("step", "micro"):
            raise ValueError(f"ess_scope={ess_scope!r} is not one of ('step', 'micro')")
        if not isinstance(objective, Objective):
            raise ValueError(f"objective must be an Objective (e.g. lit_ess.objectives.P3O()), got {objective!r}")
        if lora is not None and not isinstance(lora, LoRA):
            raise ValueError(f"lora must be a lit_ess.lora.LoRA or null, got {lora!r}")
        self.optim, self.micro_batch, self.compute = optim, micro_batch, compute
        self.ess_watch = ESSWatch(ess_alarm)
        self.skip_guard = SkippedSteps(max_consecutive_skipped_steps)   # validates the bound
        self.cast_dtype: str | None = None         # forward dtype when a sharding callback casts (cast_forward)
        self._has_dropout: bool | None = None      # the policy's forward has dropout (found at the first step)
        self._warned_anchor = False                # P3O's kl_anchor on rows older than their proximal policy
        self.lora = lora
        self.strict_loading = lora is None         # a LoRA checkpoint holds the adapters, not the base
        if lora is not None:
            self.register_state_dict_post_hook(_adapters_only)
        self.objective = objective
        self.automatic_optimization = False
        self.policy = None
        self.ref_policy = None
        self.skipped_steps = 0
        self.rollouts: RolloutData | None = None    # the data side (attach_rollouts), None without a data module
        self.last_step: dict[str, Tensor] = {}      # detached tensors for the ratio dashboard
        self.val_reward, self.val_length = MeanMetric(), MeanMetric()   # reduced over ranks at epoch end
        self.val_pass = PassAtK()

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.compute.dtype)
        self.policy = AutoModelForCausalLM.from_pretrained(self.hparams.model_path, dtype=dtype).train()
        self._check_packing(self.policy, "model_path")
        if self.compute.logprob_chunk is not None:
            check_chunked_head(self.policy, self.compute.logprob_chunk, "model_path")
        if self.compute.disable_dropout:
            disable_dropout(self.policy)
        if self.compute.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.lora is not None:
            if self.compute.gradient_checkpointing:
                self.policy.enable_input_require_grads()   # the frozen embeddings' output must carry grad
            self.policy = self.lora.apply(self.policy)
            if self.lora.dropout > 0:
                rank_zero_warn(f"model.lora.dropout={self.lora.dropout}: the trainer scores tokens with random "
                               f"adapter masks (disable_dropout leaves LoRA's dropout alone), so on-policy ESS is not 1, "
                               f"and a resumed run does not repeat the uninterrupted one exactly; set it to 0 unless "
                               f"that is intended")
        if self.objective.ref_kl_coef and (self.lora is None or self.hparams.ref_model_path):
            ref = AutoModelForCausalLM.from_pretrained(self.hparams.ref_model_path or self.hparams.model_path, dtype=dtype)
            self._check_packing(ref, "ref_model_path")
            if self.compute.logprob_chunk is not None:
                check_chunked_head(ref, self.compute.logprob_chunk, "ref_model_path")
            self.ref_policy = ref.eval().requires_grad_(False)

    def _check_packing(self, model, where: str) -> None:
        """With packing, refuse an attention implementation that does not turn restarting position ids into
        a block-diagonal mask (transformers.masking_utils.find_packed_sequence_indices), and a family whose
        packed forward is not its padded forward (lit_ess.packing.check_packed_forward): rows would attend
        to each other."""
        impl = model.config._attn_implementation
        if self.micro_batch.packing and impl not in PACKED_ATTENTION:
            raise ValueError(f"model.micro_batch.packing=true needs attn_implementation in {sorted(PACKED_ATTENTION)} ({where}'s "
                             f"model uses {impl!r}): packed rows would attend to each other; set model.micro_batch.packing=false")
        if self.micro_batch.packing:
            check_packed_forward(model, where)

    def policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's full weights with Hugging Face names, gathered one tensor at a time (FSDP2:
        every rank must consume the iterator, in the same order); with LoRA, the merged weights, or the
        adapters alone (`lora.sync: adapter`)."""
        if self.lora is None:
            return full_weights(self.policy)
        return adapter_weights(self.policy) if self.lora.sync == "adapter" else merged_weights(self.policy)

    def sharded_models(self) -> list[torch.nn.Module]:
        """The models a sharding callback (lit_ess.callbacks.FSDP2) shards: the policy (with LoRA, the peft
        model: frozen base and trainable adapters sharded alike) and the reference."""
        return [m for m in (self.policy, self.ref_policy) if m is not None]

    def configure_optimizers(self):
        """AdamW (lit_ess.step.build_optimizer) with the learning-rate schedule of lit_ess.step.lr_factor,
        stepped once per optimizer step; the decay ends at trainer.max_steps."""
        o = self.optim
        opt = build_optimizer(self.policy, o.lr, o.betas, o.weight_decay)
        trainer = self._trainer                      # None when used without a Trainer (benchmarks, notebooks)
        total = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else None

        def factor(step: int) -> float:
            return lr_factor(step, o.warmup_steps, o.lr_schedule, total, o.min_lr_ratio)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def attach_rollouts(self, data: RolloutData) -> None:
        """The data side this module trains from (lit_ess.data.RolloutData): the waiting batches of a
        phase for proximal scoring, and the receiver of the weights, which lit_ess.callbacks.WeightSync
        reaches through `rollouts`. RolloutDataModule.setup hands itself over, once per stage."""
        self.rollouts = data

    # ------------------------------------------------------------------ step
    def _score(self, model, mb: RolloutBatch, sampling: SamplingConfig, with_grad: bool,
               with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """(logprobs [b, T], entropy [b, T] or None) of `model` on the micro-batch, processed as the
        engine sampled: logits / T -> top-k -> top-p, with T = train_temperature or the rollout's.

        The policy and the reference model are both scored here, so with reference == policy the
        reference KL is exactly 0 whatever the sampling settings.
        """
        T = sampling.temperature if self.hparams.train_temperature is None else self.hparams.train_temperature
        args = (model, mb.input_ids, mb.attention_mask, mb.completion_mask, T, sampling.top_k, sampling.top_p)
        chunk = self.compute.logprob_chunk
        with torch.enable_grad() if with_grad else torch.no_grad():
            if self.micro_batch.packing:        # lines as wide as the micro-batch's longest row (it is trimmed to it)
                return packed_logprobs(*args, with_entropy=with_entropy, width=mb.input_ids.shape[1], chunk=chunk)
            return sequence_logprobs(*args, with_entropy=with_entropy, chunk=chunk)

    def _forward(self, mb: RolloutBatch, sampling: SamplingConfig, with_grad: bool) -> tuple[Tensor, Tensor | None]:
        """(logprobs, entropy or None) of the policy on the micro-batch."""
        return self._score(self.policy, mb, sampling, with_grad,
                           with_entropy=with_grad and bool(self.objective.entropy_coef))

    def _reference(self, mb: RolloutBatch, sampling: SamplingConfig) -> Tensor | None:
        """Reference logprobs for ref_kl_coef: the reference model's, or with LoRA (no reference model)
        the base model's, scored with the adapters switched off; None without a reference penalty."""
        if self.ref_policy is not None:
            return self._score(self.ref_policy, mb, sampling, False)[0]
        if not self.objective.ref_kl_coef:
            return None
        with self.policy.disable_adapter():
            return self._score(self.policy, mb, sampling, False)[0]

    def _world(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _global_sum(self, x: Tensor) -> Tensor:
        x = x.detach().clone().to(torch.float64)
        if self._world():
            dist.all_reduce(x)
        return x

    def _grad_scale(self) -> float:
        """W when DDP/FSDP2 averages gradients over W ranks, else 1 (losses are already normalised by
        the global token count, so the ranks' gradients must be summed)."""
        return float(dist.get_world_size()) if self._world() and averages_gradients(self) else 1.0

    def on_fit_start(self) -> None:
        check_gradients_synchronised(self)
        h, ckpt = self.hparams, self._trainer.ckpt_path if self._trainer is not None else None
        self.check_weights(f"in the checkpoint {ckpt}" if ckpt else f"in model_path={h.model_path!r}",
                           f"in ref_model_path={h.ref_model_path or h.model_path!r}")

    def check_weights(self, policy_source: str, ref_source: str) -> None:
        """Stop with one line naming the first non-finite weight of the policy or the reference
        (lit_ess.health.first_nonfinite). Each rank checks its own shards; a finding on any rank stops
        every rank (a collective: every rank calls it)."""
        for what, model, where in (("policy", self.policy, policy_source), ("reference model", self.ref_policy, ref_source)):
            if model is None:
                continue
            bad = first_nonfinite(model.named_parameters())
            if self._world():
                flag = torch.tensor([float(bad is not None)], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                bad = bad or ("a weight on another rank" if flag.item() else None)
            if bad:
                raise NonFiniteError(f"{what} weight {bad} is not finite {where}: every loss and gradient would be "
                                     f"NaN; use finite weights")

    def _count_skipped(self, grad_norm: Tensor, step: int) -> None:
        """A step with a non-finite gradient norm was skipped: count it, stop at once on non-finite weights,
        and after max_consecutive_skipped_steps in a row (lit_ess.health.SkippedSteps)."""
        skipped = not bool(torch.isfinite(grad_norm))
        if skipped:
            self.skipped_steps += 1
            self.check_weights(f"after step {step}", f"after step {step}")
        self.skip_guard.update(skipped, step, float(grad_norm))

    def micro_batches(self, batch: RolloutBatch) -> list[tuple[slice | list[int], RolloutBatch]]:
        """The step's micro-batches, each with the rows of `batch` it holds (a slice or row indices), each
        trimmed to its longest row: micro_batch.tokens plans rows by their real length (attention-mask
        tokens) with lit_ess.packing.plan_micro_batches (cost rows x longest row, or with packing the sum of
        lengths), else consecutive slices of micro_batch.size rows (None = one). The one place the step is cut: the ESS pre-pass, the gradient pass (and the
        reference model in it) and the proximal scoring all use these."""
        budget = self.micro_batch.tokens
        if budget is None:
            size = batch.rows if self.micro_batch.size is None else self.micro_batch.size
            cuts = [slice(s, s + size) for s in range(0, batch.rows, size)]
        else:
            cuts = plan_micro_batches(batch.attention_mask.sum(-1).tolist(), budget, packed=self.micro_batch.packing)
        return [(rows, batch.select(rows)) for rows in cuts]

    def rank_passes(self, batch: RolloutBatch) -> tuple[list[RolloutBatch], list[tuple[RolloutBatch, float]]]:
        """This rank's micro-batches of the step, and its passes: (micro-batch, weight), the same count on every
        rank (weight 0: a repeat that only joins the collectives).

            one rank, or micro_batch.size   `micro_batches` of this rank's rows, padded by `_same_count`
            micro_batch.tokens, W ranks      every rank's rows gathered (tokens, masks, logprobs: small) and
                                             dealt by lit_ess.packing.plan_ranks: longest first to the rank
                                             with the fewest tokens (ranks within one row's length of each
                                             other), each rank's micro-batches split until all ranks run as
                                             many passes; rank r trains plan[r]

        The update is the same either way: losses are normalised by the step's global counts."""
        budget = self.micro_batch.tokens
        if budget is None or not self._world():
            mbs = [mb for _, mb in self.micro_batches(batch)]
            return mbs, self._same_count(mbs)
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, batch.to("cpu"))
        step = RolloutBatch.cat(shares)
        plan = plan_ranks(step.attention_mask.sum(-1).tolist(), budget, len(shares), packed=self.micro_batch.packing)
        mbs = [step.select(rows).to(self.device) for rows in plan[dist.get_rank()] if rows]
        pad = mbs[0] if mbs else step.select([0]).to(self.device)
        return mbs, [(mb, 1.0) for mb in mbs] + [(pad, 0.0)] * (len(plan[0]) - len(mbs))

    def _same_count(self, mbs: list[RolloutBatch], pad: RolloutBatch | None = None) -> list[tuple[RolloutBatch, float]]:
        """(micro-batch, weight) pairs, padded to the largest count over ranks with weight-0 repeats (of
        `pad` when this rank has no micro-batch)."""
        out = [(mb, 1.0) for mb in mbs]
        if self._world():
            n = torch.tensor([len(mbs)], dtype=torch.float64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            out += [(mbs[0] if mbs else pad, 0.0)] * (int(n) - len(mbs))
        return out

    @torch.no_grad()
    def score_proximal(self, batches: list[RolloutBatch], pad: RolloutBatch) -> None:
        """Store on each batch its proximal logprobs: the policy's logprobs with the current weights,

            prox_logprobs [B, T] = policy(batch) in the step's micro-batches (`micro_batches`), no grad
            proximal             = Proximal(this optimizer step, "scored")

        scored exactly as the gradient pass scores (`_forward`: train temperature, top-k, top-p, LoRA
        adapters on), on each batch's own device. A collective under FSDP2: every rank must call it,
        also one with nothing to score; the ranks run the same number of forwards (no-op repeats of a
        micro-batch of `pad`, a batch this rank holds).
        """
        jobs = []                                             # (batch, its rows, micro-batch)
        for b in batches:
            b.prox_logprobs = torch.zeros_like(b.behavior_logprobs)
            jobs += [(b, rows, mb) for rows, mb in self.micro_batches(b)]
        passes = self._same_count([mb for _, _, mb in jobs], pad=self.micro_batches(pad)[0][1])
        for i, (mb, weight) in enumerate(passes):
            lp = self._forward(mb.to(self.device), mb.sampling, False)[0]
            if weight:
                b, rows, _ = jobs[i]
                b.prox_logprobs[rows, :lp.shape[1]] = lp.to(b.prox_logprobs)
        for b in batches:
            b.proximal = Proximal(self.global_step, "scored")

    def _proximal(self, mb: RolloutBatch, lp: Tensor) -> Tensor | None:
        """log pi_prox of the micro-batch [b, T] (`mb.proximal` says where it comes from); None when no step
        scored its phase."""
        if mb.proximal is None:
            return None
        return lp.detach() if mb.proximal.source == "own_pass" else mb.prox_logprobs

    def _step_counts(self, mbs: list[RolloutBatch]) -> StepCounts:
        """The step's completion tokens N and sequences over all micro-batches and ranks, and n_r, this
        rank's tokens (float64 scalars)."""
        masks = [mb.completion_mask for mb in mbs]
        local = sum(m.sum() for m in masks).to(torch.float64)
        return StepCounts(tokens=self._global_sum(local), seqs=self._global_sum(sum((m.sum(-1) > 0).sum() for m in masks)),
                          local_tokens=local)

    def accumulate_gradients(self, batch: RolloutBatch) -> tuple[dict[str, float], Tensor | None]:
        """Forward and backward every micro-batch of one optimizer step; return (metrics of the whole
        step, step ESS e_B or None). Gradients accumulate in the parameters' .grad; the caller clips
        and steps.

            micro-batches    `rank_passes`: `micro_batches` (micro_batch.size rows or micro_batch.tokens),
                             the same count on every rank; with micro_batch.tokens on several ranks the
                             step's rows dealt to the ranks by token count
            counts           N tokens and sequences of the whole step (`_step_counts`)
            ESS pre-pass     e_B over the whole step, when it spans several passes (`ess_prepass`)
            gradient pass    forward, objective, backward per micro-batch (`gradient_pass`)
            metrics          combined over micro-batches and ranks by lit_ess.metrics.RULES (`step_metrics`)
        """
        if self.objective.needs_proximal and batch.proximal is None:
            raise ValueError(_no_proximal(self.objective, "this batch has none (batch.proximal is None)"))
        if (self.objective.proximal_stands_for_behavior and not self._warned_anchor and batch.rows
                and int(batch.versions.min()) < batch.proximal.step):
            self._warned_anchor = True
            rank_zero_warn(f"step {self.global_step}: rows sampled by the weights of step {int(batch.versions.min())} "
                           f"are anchored at the proximal policy of step {batch.proximal.step} ({type(self.objective).__name__}"
                           f".kl_anchor: behavior_at_train_temperature): the trainer no longer holds their behaviour "
                           f"weights, so the KL anchor is the newer policy at the train temperature (async mode, or "
                           f"data.schedule.max_staleness > data.batch.steps_per_rollout - 1); warned once")
        sampling = batch.sampling
        mbs, passes = self.rank_passes(batch)
        counts = self._step_counts(mbs)
        step_ess = None                        # {"ess": e_B} (P4O: and "proximal_ess": e_prox) of the whole step
        if self.objective.needs_ess and self.hparams.ess_scope == "step" and (len(mbs) > 1 or self._world()):
            step_ess = self.ess_prepass(passes, sampling)
        metrics, log_ratio, mask = self.gradient_pass(passes, sampling, counts, step_ess)
        cap = None if step_ess is None else min(step_ess.values())     # the weight's cap: e_B; P4O's e_mix
        return self.step_metrics(metrics, log_ratio, mask, counts, cap, several=len(mbs) > 1)

    @torch.no_grad()
    def ess_prepass(self, passes: list[tuple[RolloutBatch, float]], sampling: SamplingConfig) -> dict[str, Tensor]:
        """e_B of the whole step, before any gradient: a no-grad forward of every micro-batch.

            rho_t = exp(lp_t - lb_t)                   lp, lb: [b, T] of each micro-batch
            e_B   = (sum_t rho_t)^2 / (N sum_t rho_t^2)   over the valid tokens of all micro-batches and ranks

        and for P4O (`objective.needs_proximal_ess`) e_prox of exp(lp_t - lprox_t) alike (`ess_stats_of`).
        Kept as mergeable log-space sums (lit_ess.objectives.ESSStats: max m, sum e^(lr - m),
        sum e^(2 (lr - m)), n), merged over micro-batches, then all-reduced over ranks. Padding passes
        (weight 0) run the forward (a collective under FSDP) and add empty statistics, so a rank with
        nothing of its own still joins the all-reduce. Returns the objective's keywords, float64 scalars:
        {"ess": e_B} (P4O: and "proximal_ess": e_prox).
        """
        stats: dict[str, ESSStats] = {}
        for mb, weight in passes:
            lp = self._forward(mb, sampling, False)[0]
            valid = finite_mask(mb.completion_mask, mb.behavior_logprobs, lp)
            part = self.ess_stats_of(mb, lp, valid if weight else torch.zeros_like(valid))
            stats = {k: stats[k].merge(s) if k in stats else s for k, s in part.items()}
        return {k: (s.all_reduce() if self._world() else s).value() for k, s in stats.items()}

    def ess_stats_of(self, mb: RolloutBatch, lp: Tensor, valid: Tensor) -> dict[str, ESSStats]:
        """Partial ESS statistics of a micro-batch's `valid` tokens ([b, T]), by the objective keyword they
        become: "ess" of lp - lb, and for P4O "proximal_ess" of lp - lprox (its proximal logprobs,
        `_proximal`; a non-finite one drops the token, as the objective's NaN masking does)."""
        lp = lp.detach()
        out = {"ess": ess_stats(lp - mb.behavior_logprobs, valid)}
        if self.objective.needs_proximal_ess:
            prox = self._proximal(mb, lp)
            out["proximal_ess"] = ess_stats(lp - prox, valid & torch.isfinite(prox))
        return out

    def gradient_pass(self, passes: list[tuple[RolloutBatch, float]], sampling: SamplingConfig, counts: StepCounts,
                      step_ess: dict[str, Tensor] | None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Forward, objective and backward of each micro-batch; gradients add up in .grad.

            lp, entropy [b, T] = policy(mb)                  ref [b, T] = reference(mb) (ref_kl_coef > 0)
            e_B = step_ess, else this micro-batch's (one micro-batch; or scope micro, over ranks); P4O's
                  e_prox alike
            L_mb = objective(lp, lb, A, mask; e_B, N, N_seqs)    aggregated over the step's N tokens, so
                                                                 sum_mb L_mb = the step's loss
            backward(W * weight * L_mb)      W: DDP/FSDP average gradients over W ranks; weight 0: padding

        Returns (this rank's metrics, combined over its micro-batches by lit_ess.metrics.accumulate;
        token-weighted ones are means over its tokens), and the log-ratios lp - lb [n] with their
        valid-token mask [n] of all its micro-batches, flattened.
        """
        acc: dict[str, Tensor] = {}              # tensors until the end: no device sync per micro-batch
        log_ratios, masks = [], []
        scale = self._grad_scale()
        for mb, weight in passes:
            ref = self._reference(mb, sampling)         # first: its forward's transients never meet the policy's graph
            lp, ent = self._forward(mb, sampling, True)
            valid = finite_mask(mb.completion_mask, mb.behavior_logprobs, lp)
            ess = step_ess or {}
            if self.objective.needs_ess and step_ess is None:                  # one micro-batch, or micro scope
                over_ranks = self._world() and self.hparams.ess_scope == "micro"
                parts = self.ess_stats_of(mb, lp, valid if weight else torch.zeros_like(valid))
                ess = {k: (st.all_reduce() if over_ranks else st).value() for k, st in parts.items()}
            out = self.objective(lp, mb.behavior_logprobs, mb.advantages, mb.completion_mask, **ess,
                                 proximal_logprobs=self._proximal(mb, lp), ref_logprobs=ref, entropy=ent,
                                 num_tokens=counts.tokens, num_seqs=counts.seqs, norm_len=sampling.max_new_tokens)
            loss = out.loss * (scale * weight)
            if self._trainer is not None:
                self.manual_backward(loss)
            else:                                   # used without a Trainer (tests, notebooks)
                loss.backward()
            if not weight:                          # a padding pass: gradients and metrics unchanged
                continue
            accumulate(acc, out.metrics, mb.completion_mask.sum())
            log_ratios.append((lp.detach() - mb.behavior_logprobs).flatten())
            masks.append(valid.flatten())
        finish_token_means(acc, counts.local_tokens)
        return acc, torch.cat(log_ratios), torch.cat(masks)

    def step_metrics(self, local: dict[str, Tensor], log_ratio: Tensor, mask: Tensor, counts: StepCounts,
                     step_ess: Tensor | None, several: bool) -> tuple[dict[str, float], Tensor | None]:
        """The step's metrics over all ranks, and its ESS (the one that caps the weight: e_B; P4O's e_mix).
        `log_ratio`, `mask`: [n], this rank's tokens.

        With several micro-batches the ratio statistics (mean, min, max, quantiles, KL to pi_b, capped
        fraction) are taken again over all of this rank's tokens at once: the parameters did not change
        within the step. Then every key is combined over ranks by its rule (lit_ess.metrics.RULES;
        token_mean keys weighted by n_r / N). An objective that does not use the ESS still logs it
        (`train/ess`), as a diagnostic of how off-policy its data was. `self.last_step` keeps the step's token
        log-ratios and capped weights min(rho, e_B) for the ratio dashboard.
        """
        ess = step_ess if step_ess is not None else local.get("train/ess")
        if several:          # one micro-batch: the objective's ratio statistics are already the step's
            local.update({k: v.double() for k, v in ratio_metrics(log_ratio[None], mask[None], ess).items()})
        share = counts.local_tokens / counts.tokens.clamp(min=1.0)
        metrics = reduce_over_ranks(local, share, self.device)
        if not self.objective.needs_ess:       # diagnostic: how off-policy was the data (every rank reduces)
            st = ess_stats(log_ratio, mask)
            st = st.all_reduce() if self._world() else st
            if mask.any() or self._world():
                metrics["train/ess"] = float(st.value())
        self.last_step = {"log_ratio": log_ratio[mask].float().cpu()}
        if ess is not None:
            self.last_step["weight"] = torch.minimum(self.last_step["log_ratio"].exp(), ess.float().cpu())
        return metrics, ess

    def training_step(self, batch: RolloutBatch, batch_idx: int):
        """One RL iteration, in the order of lit_ess/reference.py:

            batch        the step's rows, refused when older than max_staleness         (`check_batch`)
            proximal     log pi_prox of the batch's phase, when the objective uses it   (`score_phase`)
            update       gradients of every micro-batch, clip, one optimizer step       (`update`)
            weight push  after the step, by lit_ess.callbacks.WeightSync when the engine generates next

        then the step's metrics, combined over ranks, are logged."""
        step = self.global_step
        lag = self.check_batch(batch)                                      # [B] policy lag of each row (oldest token)
        token_lag = batch.token_lags(step)                                 # [N] of each trained token
        proximal_seconds = self.score_phase(batch)
        t0 = time.perf_counter()                     # perf/train_seconds: forward, backward, clip, optimizer
        metrics, grad_norm, lr = self.update(batch)
        train_seconds = time.perf_counter() - t0

        per_rank = {"train/grad_norm": float(grad_norm), "train/skipped_steps": float(self.skipped_steps),
                    "train/lr": lr, "train/batch_rows": float(batch.rows),
                    "train/policy_lag": float(lag.mean()), "train/policy_lag_max": float(lag.max()),   # 0 = on-policy
                    "train/token_lag": float(token_lag.mean()) if token_lag.numel() else 0.0,
                    "perf/train_seconds": train_seconds, **batch.stats}
        logs = dict(metrics)                                              # already over all ranks
        logs.update(reduce_over_ranks(per_rank, device=self.device))      # the step's rows, lag, rollout statistics
        self._check_ess(logs, self.step_facts(batch.sampling, batch.engine_dtype, logs["train/policy_lag_max"]), step)
        self.last_step["policy_lag"] = lag.cpu()
        self.last_step["token_lag"] = token_lag.cpu()
        self._log_step(logs)
        if proximal_seconds is not None:        # on every step that starts a phase, whatever log_every_n_steps
            for lg in self.loggers:             # this rank's (rank 0's is written)
                lg.log_metrics({"perf/proximal_seconds": proximal_seconds}, step=self.global_step)

    def check_batch(self, batch: RolloutBatch) -> Tensor:
        """The policy lag of each row, [B] (optimizer steps since the weights that sampled it); a row older
        than the batch's max_staleness stops the run."""
        step = self.global_step
        lag = step - batch.versions.float()
        if float(lag.max()) > batch.max_staleness:
            raise RuntimeError(f"step {step} got rows sampled at step {int(batch.versions.min())}, older than "
                               f"data.schedule.max_staleness={batch.max_staleness}: the batch was assembled before the previous "
                               f"update (a prefetching data loader?). Use RolloutDataModule's own train_dataloader")
        return lag

    def score_phase(self, batch: RolloutBatch) -> float | None:
        """Proximal logprobs log pi_prox, when the objective uses them (`objective.needs_proximal`): once per
        rollout phase, with the weights of the step that starts training it (verl's and TRL's "old"
        policy; in async mode the weights of the step that first trains the phase, as AReaL does).

            the batch trained now, its phase's first:  Proximal(step, "own_pass"): its gradient pass's
                                                       lp.detach() (same weights, same forward: no extra pass)
            the phase's waiting batches:               scored now, no grad (`score_proximal`); the data side
                                                       keeps them in its checkpoint, so a mid-phase resume
                                                       keeps them

        A phase's first batch is the first of its batches served (index 0, or a later one when the
        staleness filter dropped the first). Cost: k - 1 no-grad forwards per phase of k steps
        (benchmarks/proximal.py). With several ranks every rank scores at every step (the forwards are
        collectives). Returns the seconds spent when this step starts a phase, else None."""
        starts = batch.proximal is None
        if not self.objective.needs_proximal or not (starts or self._world()):
            return None
        if self.rollouts is None:
            raise ValueError(_no_proximal(self.objective, "no data module attached its phases (attach_rollouts)"))
        t0 = time.perf_counter()
        waiting = [b for b in self.rollouts.waiting_batches(batch.phase) if b.proximal is None] if starts else []
        if starts:
            batch.proximal = Proximal(self.global_step, "own_pass")
        self.score_proximal(waiting, pad=batch)       # every rank, every step: the forwards are collectives
        return time.perf_counter() - t0 if starts else None

    def update(self, batch: RolloutBatch) -> tuple[dict[str, float], Tensor, float]:
        """The step's gradients (`accumulate_gradients`), clipped, and one optimizer step; a step whose
        gradient norm is not finite is skipped and counted. Returns (the step's metrics over all ranks,
        ||g|| before clipping, the learning rate the step is taken with)."""
        opt, sched, step = self.optimizers(), self.lr_schedulers(), self.global_step
        metrics, _ = self.accumulate_gradients(batch)
        grad_norm = self._clip_and_norm()
        lr = sched.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
        self._count_skipped(grad_norm, step)
        return metrics, grad_norm, lr

    def step_facts(self, sampling: SamplingConfig, engine_dtype: str | None, lag_max: float) -> StepFacts:
        """What this step declares for the ESS alarm (lit_ess.health.exact_on_policy): the batch's sampling
        settings and engine dtype, the step's largest lag (over ranks), and the trainer's precision,
        stored dtype, FSDP2 cast, LoRA and dropout."""
        return StepFacts(lag_max=lag_max, engine_dtype=engine_dtype,
                         precision=str(self._trainer.precision) if self._trainer is not None else "32-true",
                         model_dtype=self.compute.dtype, cast_dtype=self.cast_dtype, lora=self.lora is not None,
                         dropout=self._dropout(), sample_temperature=sampling.temperature,
                         train_temperature=sampling.temperature if self.hparams.train_temperature is None
                         else self.hparams.train_temperature)

    def _check_ess(self, logs: dict[str, float], facts: StepFacts, step: int) -> None:
        """The lag-0 ESS alarm (lit_ess/health.py) on the step's reduced metrics, the same on every rank:
        warns once (rank 0), or raises with ess_alarm.error; logs the cumulative count."""
        if self.ess_watch.threshold is None:
            return
        message = self.ess_watch.check(step, logs.get("train/ess"), logs.get("train/ratio_mean"), facts)
        if message:
            rank_zero_warn(message)
        logs["train/ess_alarms"] = float(self.ess_watch.count)

    def cast_forward(self, dtype: str | None) -> None:
        """A sharding callback casts the forward to `dtype` (lit_ess.callbacks.FSDP2's param_dtype; None: no
        cast): a fact of the ESS alarm (`step_facts`)."""
        self.cast_dtype = dtype

    def _dropout(self) -> bool:
        """Whether the policy's forward drops units at random (then lag-0 ESS is below 1 on a healthy run)."""
        if self._has_dropout is None:
            self._has_dropout = has_dropout(self.policy)
        return self._has_dropout

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_ess"] = {"skipped_steps": self.skipped_steps,     # cumulative across resumes
                                 "ess_alarms": self.ess_watch.count}
        if self.lora is not None:       # the state dict holds the adapters only (_adapters_only): name their base
            checkpoint["lit_ess"]["lora_base"] = base_fingerprint(self.hparams.model_path)
            checkpoint["lit_ess"]["lora"] = self.lora.shape()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("lit_ess", {})
        self.check_checkpoint_settings(saved)
        self.check_shapes(checkpoint.get("state_dict") or {})
        self.skipped_steps = saved.get("skipped_steps", 0)
        self.ess_watch.count = saved.get("ess_alarms", 0)
        if self.lora is not None:
            ours = {f"policy.{n}" for n in adapter_state(self.policy)}
            keys = set(checkpoint.get("state_dict", ours))     # sharded: DCP loaded exactly our keys already
            missing = sorted(ours - keys) + sorted(keys - ours)
            if missing:
                raise ValueError(f"this LoRA checkpoint's adapter tensors differ from the model's: {missing[:3]} "
                                 f"(another rank or target_modules?)")

    def check_shapes(self, state: dict[str, Tensor]) -> None:
        """Stop with one line naming a tensor and its two shapes, and the checkpoint, when the checkpoint's
        weights are those of a model of another shape (width, vocabulary; with full weights also another
        depth), instead of load_state_dict's list of mismatches."""
        ours = self.state_dict()
        other = [n for n, t in state.items() if n in ours and tuple(t.shape) != tuple(ours[n].shape)]
        where = f"the checkpoint {self._trainer.ckpt_path if self._trainer is not None else ''}".rstrip()
        fix = f"than model_path={self.hparams.model_path!r}: resume with the model it was trained from"
        if other:
            n = other[0]
            raise ValueError(f"{where} holds a model of another shape {fix} ({n}: {list(state[n].shape)} in the "
                             f"checkpoint, {list(ours[n].shape)} in the model; {len(other)} tensor(s) differ)")
        missing, extra = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
        if self.strict_loading and state and (missing or extra):
            raise ValueError(f"{where} holds a model of another shape {fix} ({len(missing)} of the model's tensors "
                             f"missing, e.g. {missing[:1]}; {len(extra)} unknown to it, e.g. {extra[:1]})")

    def check_checkpoint_settings(self, saved: dict) -> None:
        """Stop with one line when a checkpoint's `lit_ess` block (on_save_checkpoint) does not fit this
        module: LoRA adapters without model.lora or the reverse, another base model, other adapter
        settings. on_load_checkpoint calls it; so does the CLI before a folder of shards is loaded
        (ModelParallelStrategy loads the shards first, where a mismatch is a long CheckpointException)."""
        lora_shape = saved.get("lora")
        if self.lora is None:
            if "lora_base" in saved:
                was = ", ".join(f"{k}={v!r}" for k, v in (lora_shape or {}).items())
                raise ValueError(f"this checkpoint holds LoRA adapters (model.lora {was}), not full weights: set "
                                 f"model.lora to resume or validate it")
            return
        if "lora_base" not in saved:
            raise ValueError("model.lora is set but this checkpoint holds full weights (trained without LoRA)")
        if saved["lora_base"] != base_fingerprint(self.hparams.model_path):
            raise ValueError(f"this LoRA checkpoint was trained on another base model than model_path="
                             f"{self.hparams.model_path!r} (fingerprints differ)")
        was, now = lora_shape or self.lora.shape(), self.lora.shape()
        changed = sorted(k for k in was if was[k] != now.get(k))
        if changed:
            then_, now_ = (", ".join(f"{k}={d[k]!r}" for k in changed) for d in (was, now))
            raise ValueError(f"this LoRA checkpoint was trained with model.lora {then_} (now {now_}): resume "
                             f"with the same adapter settings")

    def _log_step(self, logs: dict[str, float]) -> None:
        """One `log_metrics` call per logger every `log_every_n_steps` (x-axis: global step).

        Lightning's `self.log` has a cost per key, so only the keys that callbacks (ModelCheckpoint /
        EarlyStopping `monitor`) and the progress bar need go through it, with `logger=False`.
        """
        for key in ("train/ess", "train/loss", "rollout/reward_mean"):
            if key in logs:
                self.log(key, logs[key], prog_bar=key != "train/loss", logger=False, batch_size=1)
        every = self.trainer.log_every_n_steps if self._trainer is not None else 1
        if self.global_step % max(1, every) == 0:
            for lg in self.loggers:
                lg.log_metrics(logs, step=self.global_step)

    def validation_step(self, batch: EvalResult, batch_idx: int):
        """Held-out prompts sampled by the engine with the current weights (n samples each) and scored
        by the data module: each sample's reward and length, `[P, n]`. A sample passes when its reward
        is 1. The metrics are reduced over ranks (torchmetrics)."""
        self.val_reward.update(batch.reward)
        self.val_length.update(batch.length)
        self.val_pass.update(batch.reward >= 1.0)
        self.log("val/reward_mean", self.val_reward, on_step=False, on_epoch=True)
        self.log("val/response_len", self.val_length, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        """`val/pass@k` for k = 1..n: the unbiased estimator, averaged over every rank's prompts."""
        if not self.val_pass.update_called:
            return
        for k, value in enumerate(self.val_pass.compute().tolist(), start=1):
            self.log(f"val/pass@{k}", value, sync_dist=True)     # equal on every rank after compute
        self.val_pass.reset()

    def _clip_and_norm(self) -> Tensor:
        """Clip the policy's global gradient norm to max_grad_norm; return the norm before clipping."""
        return clip_gradients(self.policy.parameters(), self.optim.max_grad_norm)


def _adapters_only(module: PolicyModule, state: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a LoRA PolicyModule: keep the policy's adapters alone (lit_ess.lora.is_adapter_key),
    so checkpoints hold them only, and a sharded checkpoint (ModelParallelStrategy loads by asking the
    shards for the keys of this state dict) is read without the frozen base it never held."""
    if module.policy is None:
        return
    for k in [k for k in state if k.startswith(prefix)]:
        if not (k.startswith(f"{prefix}policy.") and is_adapter_key(k)):
            del state[k]


def _no_proximal(objective: Objective, why: str) -> str:
    return (f"objective {type(objective).__name__} uses the trainer's proximal logprobs, which training_step scores "
            f"from the data side's waiting batches (lit_ess.data.RolloutData, e.g. RolloutDataModule): {why}")


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Full (unsharded) weights on the CPU, for an export (every rank must call it under FSDP2)."""
    return {k: v.detach().cpu() for k, v in full_weights(model)}


def averages_gradients(module: L.LightningModule) -> bool:
    """True when the policy's gradients are averaged over ranks: FSDP2 shards (lit_ess.callbacks.FSDP2) or a
    DDP wrapper (strategy: ddp)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    trainer = module._trainer
    return isinstance(module.policy, FSDPModule) or (trainer is not None and isinstance(trainer.model,
                                                                                        DistributedDataParallel))


def check_gradients_synchronised(module: L.LightningModule) -> None:
    """Refuse several ranks that would each train alone (e.g. ModelParallelStrategy without FSDP2)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not averages_gradients(module):
        raise ValueError(f"{dist.get_world_size()} ranks but nothing synchronises the policy's gradients: use "
                         f"strategy: ddp, or ModelParallelStrategy with lit_ess.callbacks.FSDP2")
