"""RatioDashboard: histograms of the importance ratios and a custom-scalars layout.

Every `every_n_steps` it writes histograms of the step's token log-ratios log(pi_theta / pi_b) and of
the capped weights min(rho, e_B) (P3O), of the rows' policy lag and of the trained tokens' lag (steps;
below the row's oldest-token lag when the weights changed in flight, lit_ess.engines VLLMServerConfig
weight_update: in_flight), gathered from all ranks and written by rank 0 (the logger is a
dummy elsewhere). At fit start it writes a custom-scalars layout: charts of one scale each
(SCALE), ESS alone, grouped as off-policy, optimisation, rollouts and time.
They go to every logger of the trainer through lit_ess.trackers: TensorBoard and W&B show histograms,
MLflow and others get p05/p50/p95 scalars (said once at start); the layout is TensorBoard's.
"""
from __future__ import annotations

import lightning as L
import torch

from lit_ess import trackers
from lit_ess.knobs import check

# The scale of each charted key. A chart holds keys of one scale: TensorBoard autoscales each chart to its
# data, so ESS alone shows a drop from 1.0 to 0.99, and the learning rate (1e-6) is not a flat line under a
# loss of 0.5 (tests/test_metrics.py checks every chart against the keys lit-ess logs, lit_ess.metrics.RULES).
SCALE = {key: scale for scale, keys in {
    "ess": ["train/ess", "train/ess_b", "train/ess_prox", "train/ess_mix"],
    "ratio": ["train/ratio_p05", "train/ratio_p50", "train/ratio_p95"],
    "ratio tail": ["train/ratio_max"],                       # one token's ratio: can be 100x the quantiles
    "fraction": ["train/capped_frac", "train/clip_ratio", "rollout/degenerate_frac", "rollout/truncated_frac",
                 "rollout/multi_version_frac", "perf/trainer_wait_frac", "perf/worker_idle_frac"],
    "kl": ["train/kl_behavior", "train/approx_kl", "train/kl_term"],
    "loss": ["train/loss", "train/policy_loss"],
    "grad norm": ["train/grad_norm"],
    "lr": ["train/lr"],
    "reward": ["rollout/reward_mean", "rollout/reward_std"],
    "tokens": ["rollout/response_len", "rollout/response_len_max"],
    "steps": ["train/policy_lag", "train/policy_lag_max", "train/token_lag"],
    "rows": ["rollout/stale_dropped", "rollout/buffer_size"],
    "seconds": ["rollout/gen_seconds", "rollout/reward_seconds", "perf/train_seconds", "perf/weight_sync_seconds"],
}.items() for key in keys}


def _chart(*keys: str) -> list:
    """A Multiline chart of these keys. TensorBoard reads a tag as a regular expression that may match
    anywhere: `train/ess` alone would also chart train/ess_alarms (a count), so each key is anchored."""
    return ["Multiline", [f"^{k}$" for k in keys]]


LAYOUT = {
    "lit-ess: off-policy": {
        "ESS e_B (1 = on-policy)": _chart("train/ess"),
        "ESS per anchor (P4O)": _chart("train/ess_b", "train/ess_prox", "train/ess_mix"),
        "Ratio quantiles p05 / p50 / p95": _chart("train/ratio_p05", "train/ratio_p50", "train/ratio_p95"),
        "Ratio max": _chart("train/ratio_max"),
        "Capped / clipped token fraction": _chart("train/capped_frac", "train/clip_ratio"),
        "KL to pi_b (nats)": _chart("train/kl_behavior", "train/approx_kl", "train/kl_term"),
    },
    "lit-ess: optimisation": {
        "Loss": _chart("train/loss", "train/policy_loss"),
        "Grad norm": _chart("train/grad_norm"),
        "Learning rate": _chart("train/lr"),
    },
    "lit-ess: rollouts": {
        "Reward": _chart("rollout/reward_mean", "rollout/reward_std"),
        "Response length (tokens)": _chart("rollout/response_len", "rollout/response_len_max"),
        "Degenerate / truncated / multi-version fraction": _chart("rollout/degenerate_frac", "rollout/truncated_frac",
                                                                   "rollout/multi_version_frac"),
        "Policy lag (steps)": _chart("train/policy_lag", "train/policy_lag_max", "train/token_lag"),
        "Stale dropped, buffer (rows)": _chart("rollout/stale_dropped", "rollout/buffer_size"),
    },
    "lit-ess: time": {
        "Seconds per phase": _chart("rollout/gen_seconds", "rollout/reward_seconds", "perf/train_seconds",
                                    "perf/weight_sync_seconds"),
        "Trainer wait / worker idle fraction": _chart("perf/trainer_wait_frac", "perf/worker_idle_frac"),
    },
}


class RatioDashboard(L.Callback):
    """Histograms of the importance ratios and policy lag, and the custom-scalars layout.

    Args:
        every_n_steps: histogram period in optimizer steps (>= 1).
        max_values: at most this many token values per histogram (a random subset beyond it; >= 1).
    """

    writes = ("histograms", "layout")               # what lit_ess.trackers.notices checks the loggers for

    def __init__(self, every_n_steps: int = 1, max_values: int = 100_000):
        check("RatioDashboard.every_n_steps", every_n_steps, ge=1, integer=True)
        check("RatioDashboard.max_values", max_values, ge=1, integer=True)
        self.every_n_steps, self.max_values = every_n_steps, max_values

    def on_fit_start(self, trainer, pl_module) -> None:
        trackers.announce(trainer)
        if trainer.is_global_zero:
            trackers.log_layout(trainer, LAYOUT)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps:
            return
        values = getattr(pl_module, "last_step", {})
        gathered = {}
        for name, t in values.items():
            if trainer.world_size > 1:
                t = torch.cat(_all_gather_varlen(t, pl_module.device))
            if t.numel() > self.max_values:
                t = t[torch.randperm(t.numel())[: self.max_values]]
            gathered[name] = t
        if not trainer.is_global_zero:
            return
        for name, key in (("log_ratio", "ratio/log_ratio"), ("weight", "ratio/capped_weight"),
                          ("policy_lag", "rollout/policy_lag"), ("token_lag", "rollout/token_lag")):
            if name in gathered and gathered[name].numel():
                trackers.log_histogram(trainer, key, gathered[name], step)


def _all_gather_varlen(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every rank's 1-D tensor (of any length), on the CPU. The collectives run on `device` (NCCL
    accepts only CUDA tensors)."""
    import torch.distributed as dist

    n = torch.tensor([t.numel()], device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=t.dtype, device=device)
    padded[: t.numel()] = t.to(device)
    out = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return [o[: int(s.item())].cpu() for o, s in zip(out, sizes)]
