"""PolicyModule: the policy, the objective and one optimizer step per `training_step`.

Manual optimization: a step's batch (one `RolloutBatch`) is split into micro-batches, each
is forwarded and back-propagated, then gradients are clipped and the optimizer steps once. Token-mean
losses are normalised by the token count of the *whole step* (all micro-batches, all ranks), so the
update does not depend on `micro_batch_size`.

The ESS of P3O is taken over the whole step as well (`ess_scope: step`): with several micro-batches a
no-grad pre-pass collects its statistics first. `ess_scope: micro` reproduces the authors' reference,
which computes it per micro-batch. Every objective logs the step's ESS (`train/ess`), as a diagnostic
of how off-policy its data was; only P3O uses it in the loss.

Data parallel (W ranks, DDP or FSDP2): each rank holds its share of the step's rows. Losses are
normalised by the global counts, and DDP/FSDP *average* gradients over ranks, so each rank's loss is
scaled by W before backward: the update and `train/grad_norm` equal those of one rank with the whole
batch. Ranks run the same number of forward/backward passes (a rank with fewer micro-batches runs
zero-weighted extra passes), since every pass under FSDP is a collective. Logged metrics are reduced
over ranks (sums, token-weighted means, min/max); ratio quantiles are token-weighted means of the
ranks' quantiles.
"""
from __future__ import annotations

import math
import time
from typing import Iterator, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import MeanMetric

from .logprobs import sequence_logprobs
from .metrics import PassAtK
from .model_path import check_model_path
from .objectives import P3O, Objective, ess_stats, ratio_metrics
from .rollout import RolloutBatch

MIN_MAX_KEYS = {"ratio_min": torch.minimum, "ratio_max": torch.maximum, "log_ratio_abs_max": torch.maximum}
SUMMED_KEYS = {"loss", "policy_loss", "kl_term", "kl_ref", "entropy", "nonfinite_tokens", "tokens"}


class PolicyModule(L.LightningModule):
    """Args:
        model_path: Hugging Face causal LM folder or name.
        objective: the objective and its hyper-parameters, a class of lit_ess.objectives: P3O (default),
            GRPO, DAPO, GSPO, CISPO, DecoupledPPO, REINFORCE. ref_kl_coef > 0 loads a frozen reference.
        ref_model_path: reference model for ref_kl_coef; default model_path.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps.
        lr_schedule: "constant", "cosine" or "linear" decay to min_lr_ratio * lr at trainer.max_steps.
        min_lr_ratio: final learning rate as a fraction of lr.
        max_grad_norm: clip the global gradient norm (None = no clipping). A step whose gradient norm is
            not finite is skipped and counted in `train/skipped_steps`.
        micro_batch_size: rows per forward/backward (None = the whole step at once).
        ess_scope: "step" (ESS over all micro-batches and ranks) or "micro" (per micro-batch).
        train_temperature: temperature of the trainer's log-probs; None = the rollout's (on-policy).
        gradient_checkpointing: trade compute for memory in the policy.
        model_dtype: dtype the policy weights are loaded in (mixed precision comes from the Trainer).
        disable_dropout: set every dropout probability of the policy to 0 (TRL's `disable_dropout`).
            With dropout on, the trainer scores tokens with a random sub-network: on-policy ESS is not 1
            and the ESS pre-pass and the gradient pass see different masks.
    """

    def __init__(
        self,
        model_path: str,
        objective: Objective = P3O(),
        ref_model_path: str | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine", "linear"] = "constant",
        min_lr_ratio: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int | None = None,
        ess_scope: Literal["step", "micro"] = "step",
        train_temperature: float | None = None,
        gradient_checkpointing: bool = False,
        model_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        disable_dropout: bool = True,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_model_path(model_path)
        if ref_model_path is not None:
            check_model_path(ref_model_path, "ref_model_path")
        if ess_scope not in ("step", "micro"):
            raise ValueError(f"ess_scope={ess_scope!r} is not one of ('step', 'micro')")
        if lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_schedule={lr_schedule!r} is not one of ('constant', 'cosine', 'linear')")
        if not isinstance(objective, Objective):
            raise ValueError(f"objective must be an Objective (e.g. lit_ess.objectives.P3O()), got {objective!r}")
        self.objective = objective
        self.automatic_optimization = False
        self.policy = None
        self.ref_policy = None
        self.skipped_steps = 0
        self.last_step: dict[str, Tensor] = {}      # detached tensors for the ratio dashboard
        self.val_reward, self.val_length = MeanMetric(), MeanMetric()   # reduced over ranks at epoch end
        self.val_pass = PassAtK()

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, self.hparams.model_dtype)
        self.policy = AutoModelForCausalLM.from_pretrained(self.hparams.model_path, dtype=dtype).train()
        if self.hparams.disable_dropout:
            disable_dropout(self.policy)
        if self.hparams.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.objective.ref_kl_coef:
            ref = AutoModelForCausalLM.from_pretrained(self.hparams.ref_model_path or self.hparams.model_path, dtype=dtype)
            self.ref_policy = ref.eval().requires_grad_(False)

    def policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's full weights with Hugging Face names, gathered one tensor at a time (FSDP2:
        every rank must consume the iterator, in the same order)."""
        return full_weights(self.policy)

    def sharded_models(self) -> list[torch.nn.Module]:
        """The models a sharding callback (lit_ess.callbacks.FSDP2) shards: the policy and the reference."""
        return [m for m in (self.policy, self.ref_policy) if m is not None]

    def configure_optimizers(self):
        h = self.hparams
        decay = [p for n, p in self.policy.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in self.policy.named_parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=h.lr, betas=tuple(h.betas))
        trainer = self._trainer                      # None when used without a Trainer (benchmarks, notebooks)
        total = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else None

        def factor(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / (h.warmup_steps + 1)
            if h.lr_schedule == "constant" or not total:
                return 1.0
            frac = min(1.0, (step - h.warmup_steps) / max(1, total - h.warmup_steps))
            shape = 0.5 * (1 + math.cos(math.pi * frac)) if h.lr_schedule == "cosine" else 1 - frac
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * shape

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ step
    def _score(self, model, mb: RolloutBatch, sampling: dict, with_grad: bool,
               with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """(logprobs, entropy or None) of `model` on the micro-batch, processed as the engine sampled:
        logits / T -> top-k -> top-p, with T = train_temperature or the rollout's temperature.

        The policy and the reference model are both scored here, so with reference == policy the
        reference KL is exactly 0 whatever the sampling settings.
        """
        T = self.hparams.train_temperature or sampling["temperature"]
        with torch.enable_grad() if with_grad else torch.no_grad():
            return sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                     T, sampling["top_k"], sampling["top_p"], with_entropy=with_entropy)

    def _forward(self, mb: RolloutBatch, sampling: dict, with_grad: bool) -> tuple[Tensor, Tensor | None]:
        """(logprobs, entropy or None) of the policy on the micro-batch."""
        return self._score(self.policy, mb, sampling, with_grad,
                           with_entropy=with_grad and bool(self.objective.entropy_coef))

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

    def _same_count(self, mbs: list[RolloutBatch]) -> list[tuple[RolloutBatch, float]]:
        """(micro-batch, weight) pairs, padded to the largest count over ranks with weight-0 repeats."""
        out = [(mb, 1.0) for mb in mbs]
        if self._world():
            n = torch.tensor([len(mbs)], dtype=torch.float64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            out += [(mbs[0], 0.0)] * (int(n) - len(mbs))
        return out

    def accumulate_gradients(self, batch: RolloutBatch) -> tuple[dict[str, float], Tensor | None]:
        """Forward and backward every micro-batch of one optimizer step; return (metrics, step ESS).

        Gradients accumulate in the parameters' .grad; the caller clips and steps.
        """
        sampling = batch.sampling
        mbs = batch.micro_batches(self.hparams.micro_batch_size)
        passes = self._same_count(mbs)
        masks = [mb.completion_mask for mb in mbs]
        local_tokens = sum(m.sum() for m in masks)
        num_tokens = self._global_sum(local_tokens)
        num_seqs = self._global_sum(sum((m.sum(-1) > 0).sum() for m in masks))
        w_rank = local_tokens / num_tokens.clamp(min=1.0)         # this rank's share of the step's tokens

        step_ess = None
        if self.objective.needs_ess and self.hparams.ess_scope == "step" and (len(mbs) > 1 or self._world()):
            stats = None
            for mb, weight in passes:                                           # no-grad pre-pass
                lp = self._forward(mb, sampling, False)[0]
                if weight:
                    s = ess_stats(lp - mb.behavior_logprobs, _finite_mask(mb, lp))
                    stats = s if stats is None else stats.merge(s)
            step_ess = (stats.all_reduce() if self._world() else stats).value()

        sums: dict[str, Tensor] = {}              # tensors until the end: no device sync per micro-batch
        log_ratios, mask_list = [], []
        scale = self._grad_scale()
        for mb, weight in passes:
            lp, ent = self._forward(mb, sampling, True)
            ref = self._score(self.ref_policy, mb, sampling, False)[0] if self.ref_policy is not None else None
            ess = step_ess
            if self.objective.needs_ess and ess is None:                       # one micro-batch, or micro scope
                tokens = _finite_mask(mb, lp) if weight else torch.zeros_like(mb.completion_mask)  # padding: none
                st = ess_stats(lp.detach() - mb.behavior_logprobs, tokens)
                ess = (st.all_reduce() if self._world() and self.hparams.ess_scope == "micro" else st).value()
            out = self.objective(lp, mb.behavior_logprobs, mb.advantages, mb.completion_mask, ess=ess,
                                 ref_logprobs=ref, entropy=ent, num_tokens=num_tokens, num_seqs=num_seqs,
                                 norm_len=sampling["max_new_tokens"])
            loss = out.loss * (scale * weight)
            if self._trainer is not None:
                self.manual_backward(loss)
            else:                                   # used without a Trainer (tests, notebooks)
                loss.backward()
            if not weight:                          # a padding pass: gradients and metrics unchanged
                continue
            w = mb.completion_mask.sum() / num_tokens.clamp(min=1.0)
            for k, v in out.metrics.items():
                v = v.detach().double()
                if k in MIN_MAX_KEYS:
                    sums[k] = MIN_MAX_KEYS[k](sums.get(k, v), v)
                elif k in SUMMED_KEYS:              # already scaled by the whole step's counts, or counts
                    sums[k] = sums.get(k, 0.0) + v
                else:                               # per-micro-batch means: token-weighted
                    sums[k] = sums.get(k, 0.0) + v * w
            log_ratios.append((lp.detach() - mb.behavior_logprobs).flatten())
            mask_list.append(_finite_mask(mb, lp).flatten())

        # step-level ratio statistics over all micro-batches (same parameters throughout the step)
        lr_all, m_all = torch.cat(log_ratios), torch.cat(mask_list)
        ess_value = step_ess if step_ess is not None else sums.get("ess")
        if len(mbs) > 1:     # one micro-batch: the objective's ratio statistics are already the step's
            for k, v in ratio_metrics(lr_all[None], m_all[None], ess_value).items():
                sums[k] = v.double() if k in MIN_MAX_KEYS else v.double() * w_rank   # token-weighted over ranks
        if self._world():
            sums = _reduce_over_ranks(sums, self.device)
        if not self.objective.needs_ess:       # diagnostic: how off-policy was the data (every rank reduces)
            st = ess_stats(lr_all, m_all)
            st = st.all_reduce() if self._world() else st
            if m_all.any() or self._world():
                sums["ess"] = st.value().double()
        self.last_step = {"log_ratio": lr_all[m_all].float().cpu()}
        if ess_value is not None:
            self.last_step["weight"] = torch.minimum(self.last_step["log_ratio"].exp(), ess_value.float().cpu())
        return {k: float(v) for k, v in sums.items()}, ess_value

    def training_step(self, batch: RolloutBatch, batch_idx: int):
        opt = self.optimizers()
        sched = self.lr_schedulers()
        step_before = self.global_step
        lag = step_before - batch.versions.float()
        if float(lag.max()) > batch.max_staleness:
            raise RuntimeError(f"step {step_before} got rows sampled at step {int(batch.versions.min())}, older than "
                               f"max_staleness={batch.max_staleness}: the batch was assembled before the previous "
                               f"update (a prefetching data loader?). Use RolloutDataModule's own train_dataloader")
        t0 = time.perf_counter()                     # perf/train_seconds: forward, backward, clip, optimizer
        sums, _ = self.accumulate_gradients(batch)

        grad_norm = self._clip_and_norm()
        lr = sched.get_last_lr()[0]                  # the rate this step is taken with
        if torch.isfinite(grad_norm):
            opt.step()
            sched.step()
        else:
            self.skipped_steps += 1
        opt.zero_grad(set_to_none=True)
        train_seconds = time.perf_counter() - t0

        logs = {f"train/{k}": v for k, v in sums.items()}
        logs.update({
            "train/grad_norm": float(grad_norm), "train/skipped_steps": float(self.skipped_steps),
            "train/lr": lr, "train/batch_rows": float(batch.rows),
            "train/policy_lag": float(lag.mean()), "train/policy_lag_max": float(lag.max()),   # 0 = on-policy
            "perf/train_seconds": train_seconds,
        })
        logs.update(batch.stats)
        if self._world():                    # the step's rows, lag and rollout statistics over all ranks
            logs.update(reduce_stats({k: logs[k] for k in (*batch.stats, *RANK_KEYS)}, self.device))
        self.last_step["policy_lag"] = lag.cpu()
        self._log_step(logs)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_ess"] = {"skipped_steps": self.skipped_steps}     # cumulative across resumes

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = checkpoint.get("lit_ess", {}).get("skipped_steps", 0)

    def _log_step(self, logs: dict[str, float]) -> None:
        """One `log_metrics` call per logger every `log_every_n_steps` (x-axis: global step).

        Lightning's per-key `self.log` costs about 0.8 ms a key on CPU (5% of a tiny-model step for ~30
        keys), so only the keys that callbacks (ModelCheckpoint/EarlyStopping `monitor`) and the
        progress bar need go through it, with `logger=False`.
        """
        for key in ("train/ess", "train/loss", "rollout/reward_mean"):
            if key in logs:
                self.log(key, logs[key], prog_bar=key != "train/loss", logger=False, batch_size=1)
        every = self.trainer.log_every_n_steps if self._trainer is not None else 1
        if self.global_step % max(1, every) == 0:
            for lg in self.loggers:
                lg.log_metrics(logs, step=self.global_step)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int):
        """Held-out prompts sampled by the engine with the current weights (n samples each) and scored
        by the data module: `{"reward": [P, n], "length": [P, n]}`. A sample passes when its reward
        is 1. The metrics are reduced over ranks (torchmetrics)."""
        self.val_reward.update(batch["reward"])
        self.val_length.update(batch["length"])
        self.val_pass.update(batch["reward"] >= 1.0)
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
        """Clip the global gradient norm and return it (before clipping). Under FSDP2 the gradients
        are DTensor shards: their norm is reduced over ranks and returned as a plain tensor."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        max_norm = self.hparams.max_grad_norm
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for every entry of the state dict, in its fixed order, with Hugging Face
    names (wrapper prefixes are stripped by the wrappers' state-dict hooks). A DTensor shard (FSDP2)
    is gathered when its turn comes, so at most one full tensor exists beside the shards; every rank
    must consume the iterator in step."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


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


def _reduce_over_ranks(sums: dict[str, Tensor], device) -> dict[str, Tensor]:
    """Step metrics of every rank combined: min/max keys by min/max, all others summed (they are
    already token-weighted shares or counts). Keys are agreed first: a rank without valid tokens
    has no ratio statistics."""
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(sums))
    keys = sorted(set().union(*keys))
    out = {}
    for op, members in ((dist.ReduceOp.SUM, [k for k in keys if k not in MIN_MAX_KEYS]),
                        (dist.ReduceOp.MIN, [k for k in keys if MIN_MAX_KEYS.get(k) is torch.minimum]),
                        (dist.ReduceOp.MAX, [k for k in keys if MIN_MAX_KEYS.get(k) is torch.maximum])):
        if not members:
            continue
        empty = 0.0 if op == dist.ReduceOp.SUM else (math.inf if op == dist.ReduceOp.MIN else -math.inf)
        t = torch.stack([sums[k].double().to(device) if k in sums else torch.tensor(empty, dtype=torch.float64,
                         device=device) for k in members])
        dist.all_reduce(t, op=op)
        out.update(zip(members, t.cpu()))
    return out


# rollout statistics: how the ranks' values of a phase combine (default: mean; every rank has as many rows)
RANK_KEYS = ("train/batch_rows", "train/policy_lag", "train/policy_lag_max")   # per rank in training_step
STAT_SUM = {"train/batch_rows", "rollout/rows", "rollout/reward_errors", "rollout/reward_timeouts", "rollout/dropped_groups", "rollout/gen_tokens_per_s",
            "rollout/stale_dropped", "rollout/buffer_size"}
STAT_MAX = {"train/policy_lag_max", "rollout/response_len_max", "rollout/gen_seconds", "rollout/reward_seconds",
            "perf/trainer_wait_frac"}


def reduce_stats(stats: dict[str, float], device) -> dict[str, float]:
    """Rollout statistics of the whole step from every rank's: sums, maxima, means; the reward std is
    pooled from the ranks' means and stds (equal row counts)."""
    keys = sorted(stats)
    vals = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    world = dist.get_world_size()
    pooled = {"rollout/reward_mean", "rollout/reward_std", "rollout/rows"} <= set(stats)
    if pooled:         # sum of r^2 on this rank, from its mean and unbiased std over m rows
        m, mu, sd = stats["rollout/rows"], stats["rollout/reward_mean"], stats["rollout/reward_std"]
        sq = torch.tensor([sd * sd * (m - 1) + m * mu * mu], dtype=torch.float64, device=device)
        dist.all_reduce(sq)
    total, top = vals.clone(), vals.clone()
    dist.all_reduce(total)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    out = {k: float(top[i]) if k in STAT_MAX else float(total[i]) if k in STAT_SUM else float(total[i]) / world
           for i, k in enumerate(keys)}
    if pooled:         # unbiased std over all M rows
        M, mu = out["rollout/rows"], out["rollout/reward_mean"]
        out["rollout/reward_std"] = max((float(sq) - M * mu * mu) / max(M - 1, 1.0), 0.0) ** 0.5
    return out


def _finite_mask(mb: RolloutBatch, lp: Tensor) -> Tensor:
    """The tokens that enter the loss, and so the ESS: completion tokens whose behaviour and trainer
    logprobs are both finite. A token outside the trainer's top-k/top-p set (-inf) or a NaN is dropped
    from both and counted in `train/nonfinite_tokens`; one rule for the pre-pass and the gradient pass."""
    return mb.completion_mask & torch.isfinite(mb.behavior_logprobs) & torch.isfinite(lp.detach())


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0: `nn.Dropout` modules and the float `attention_dropout` /
    `dropout` attributes that Hugging Face attention layers pass to their functional dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "hidden_dropout", "attn_dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
