"""RatioDashboard: histograms of the importance ratios and a custom-scalars layout.

Every `every_n_steps` it writes histograms of the step's token log-ratios log(pi_theta / pi_b) and of
the capped weights min(rho, e_B) (P3O), of the rows' policy lag and of the trained tokens' lag (steps;
below the row's oldest-token lag when the weights changed in flight, lit_ess.engines VLLMServerConfig
weight_update: in_flight), gathered from all ranks and written by rank 0 (the logger is a
dummy elsewhere). At fit start it writes a custom-scalars layout that groups ESS, KL, reward, lengths.
They go to every logger of the trainer through lit_ess.trackers: TensorBoard and W&B show histograms,
MLflow and others get p05/p50/p95 scalars (said once at start); the layout is TensorBoard's.
"""
from __future__ import annotations

import lightning as L
import torch

from lit_ess import trackers
from lit_ess.knobs import check

LAYOUT = {
    "lit-ess": {
        "ESS and ratios": ["Multiline", ["train/ess", "train/capped_frac", "train/ratio_max", "train/ratio_p95",
                                         "train/ratio_p05"]],
        "KL": ["Multiline", ["train/kl_behavior", "train/approx_kl", "train/kl_term"]],
        "Reward": ["Multiline", ["rollout/reward_mean", "rollout/reward_std", "rollout/degenerate_frac"]],
        "Lengths": ["Multiline", ["rollout/response_len", "rollout/response_len_max", "rollout/truncated_frac"]],
        "Optimisation": ["Multiline", ["train/loss", "train/grad_norm", "train/lr"]],
        "Staleness": ["Multiline", ["train/policy_lag", "train/policy_lag_max", "train/token_lag",
                                    "rollout/multi_version_frac", "rollout/stale_dropped", "rollout/buffer_size"]],
        "Throughput": ["Multiline", ["perf/trainer_wait_frac", "perf/worker_idle_frac", "perf/weight_sync_seconds"]],
    }
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
