"""LogCompletions: sample completions in TensorBoard's Text tab (TRL users know it as `log_completions`).

Every `every_n_steps` optimizer steps it writes a markdown table of up to `max_rows` rows of the step's
batch: prompt, completion, reward, advantage, the behaviour log-probability of the completion
(sum over its tokens, the log pi_b the engine sampled it with) and the policy version that sampled it. A reward bug shows here long before
the curves look odd. Rank 0 writes; the rows come from rank 0's batch. A multi-turn episode (data.env)
shows its whole conversation after the prompt, the environment's parts marked: `121[env: wrong↵37+85=]122`
(its log pi_b sums the policy's tokens only).
"""
from __future__ import annotations

import lightning as L
import torch

from lit_ess.knobs import check
from lit_ess.rollout import RolloutBatch


def _cell(text: str, limit: int) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "\u2026"
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "\u21b5") + "`"


def completions_table(batch: RolloutBatch, max_rows: int = 8, max_chars: int = 200) -> str:
    """Markdown table of the first `max_rows` rows of a rollout batch."""
    lp_sum = (batch.behavior_logprobs * batch.completion_mask).sum(-1)
    lines = ["| prompt | completion | reward | advantage | log pi_b | version |", "|---|---|---:|---:|---:|---:|"]
    for i in range(min(max_rows, len(batch.completion_texts))):
        lines.append(f"| {_cell(batch.prompt_texts[i], max_chars)} | {_cell(batch.completion_texts[i], max_chars)} "
                     f"| {float(batch.rewards[i]):.3f} | {float(batch.advantages[i]):+.3f} | {float(lp_sum[i]):.2f} "
                     f"| {int(batch.versions[i])} |")
    return "\n".join(lines)


class LogCompletions(L.Callback):
    """Sample completions of the step's batch as a table in TensorBoard's Text tab.

    Args:
        every_n_steps: write a table every this many optimizer steps (>= 1).
        max_rows: rows per table (>= 1).
        max_chars: longer prompts and completions are cut to this many characters (>= 1).
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int = 8, max_chars: int = 200):
        for name, value in (("every_n_steps", every_n_steps), ("max_rows", max_rows), ("max_chars", max_chars)):
            check(f"LogCompletions.{name}", value, ge=1, integer=True)
        self.every_n_steps, self.max_rows, self.max_chars = every_n_steps, max_rows, max_chars

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1          # the step this batch was trained at (metrics' x-axis)
        if not trainer.is_global_zero or step % self.every_n_steps or not isinstance(batch, RolloutBatch):
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        with torch.no_grad():
            table = completions_table(batch, self.max_rows, self.max_chars)
        for lg in trainer.loggers:
            if isinstance(lg, TensorBoardLogger):
                lg.experiment.add_text("completions", table, step)
