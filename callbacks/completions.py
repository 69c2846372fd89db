"""LogCompletions: a table of sample completions (TRL users know it as `log_completions`).

Every `every_n_steps` optimizer steps it writes a markdown table of up to `max_rows` rows of the step's
batch: prompt, completion, reward, advantage, the behaviour log-probability of the completion
(sum over its tokens, the log pi_b the engine sampled it with) and the policy version that sampled it. A reward bug shows here long before
the curves look odd. Rank 0 writes; the rows come from rank 0's batch. A multi-turn episode (data.env)
shows its whole conversation after the prompt, the environment's parts marked: `121[env: wrong↵37+85=]122`
(its log pi_b sums the policy's tokens only). Through lit_ess.trackers: markdown in TensorBoard's Text tab,
a wandb.Table on W&B, a JSON artifact `completions/step_NNNNNN.json` on MLflow.
"""
from __future__ import annotations

import lightning as L
import torch

from lit_ess import trackers
from lit_ess.knobs import check
from lit_ess.batch import RolloutBatch


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _cell(text: str, limit: int) -> str:
    text = _cut(text, limit)
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "\u21b5") + "`"


COLUMNS = ("prompt", "completion", "reward", "advantage", "log pi_b", "version")


def completions_rows(batch: RolloutBatch, max_rows: int = 8, max_chars: int = 200) -> list[tuple]:
    """The first `max_rows` rows of a rollout batch as plain values, one per COLUMNS (texts cut to `max_chars`)."""
    lp_sum = (batch.behavior_logprobs * batch.completion_mask).sum(-1)
    return [(_cut(batch.prompt_texts[i], max_chars), _cut(batch.completion_texts[i], max_chars), float(batch.rewards[i]),
             float(batch.advantages[i]), float(lp_sum[i]), int(batch.versions[i]))
            for i in range(min(max_rows, len(batch.completion_texts)))]


def completions_table(batch: RolloutBatch, max_rows: int = 8, max_chars: int = 200) -> str:
    """Markdown table of the first `max_rows` rows of a rollout batch."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|---:|---:|---:|---:|"]
    for prompt, completion, reward, advantage, lp, version in completions_rows(batch, max_rows, max_chars):
        lines.append(f"| {_cell(prompt, max_chars)} | {_cell(completion, max_chars)} "
                     f"| {reward:.3f} | {advantage:+.3f} | {lp:.2f} | {version} |")
    return "\n".join(lines)


class LogCompletions(L.Callback):
    """Sample completions of the step's batch as a table on every logger that holds tables.

    Args:
        every_n_steps: write a table every this many optimizer steps (>= 1).
        max_rows: rows per table (>= 1).
        max_chars: longer prompts and completions are cut to this many characters (>= 1).
    """

    writes = ("tables",)                           # what lit_ess.trackers.notices checks the loggers for

    def __init__(self, every_n_steps: int = 10, max_rows: int = 8, max_chars: int = 200):
        for name, value in (("every_n_steps", every_n_steps), ("max_rows", max_rows), ("max_chars", max_chars)):
            check(f"LogCompletions.{name}", value, ge=1, integer=True)
        self.every_n_steps, self.max_rows, self.max_chars = every_n_steps, max_rows, max_chars

    def on_fit_start(self, trainer, pl_module) -> None:
        trackers.announce(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1          # the step this batch was trained at (metrics' x-axis)
        if not trainer.is_global_zero or step % self.every_n_steps or not isinstance(batch, RolloutBatch):
            return
        with torch.no_grad():
            rows = completions_rows(batch, self.max_rows, self.max_chars)
            table = completions_table(batch, self.max_rows, self.max_chars)
        trackers.log_table(trainer, "completions", COLUMNS, rows, step, markdown=table)
