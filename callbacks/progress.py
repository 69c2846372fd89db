"""StepProgressBar: one tqdm bar over optimizer steps (not epochs) with the numbers that matter.

Lightning's default bar restarts every epoch, and one lit-ess epoch is one rollout phase (often one
step), so it would show "1/1" forever. This bar runs from 0 to `trainer.max_steps` across epochs,
shows reward, ESS and seconds per step for RL (loss and accuracy for SFT: whatever the module puts
in the progress bar), and survives a resume (it starts at the restored step).
"""
from __future__ import annotations

import sys
import time

from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.trainer.states import TrainerFn

from lit_ess.knobs import check


class StepProgressBar(ProgressBar):
    """One progress bar over optimizer steps, across epochs.

    Args:
        refresh_rate: redraw every this many optimizer steps (0 = off).
    """

    def __init__(self, refresh_rate: int = 1):
        super().__init__()
        check("StepProgressBar.refresh_rate", refresh_rate, ge=0, integer=True)
        self.refresh_rate = refresh_rate
        self._bar = None
        self._t0 = 0.0
        self._shown = 0.0
        self._start = 0

    def disable(self) -> None:
        self.refresh_rate = 0

    def enable(self) -> None:
        pass

    @property
    def is_enabled(self) -> bool:
        return self.refresh_rate > 0

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.is_enabled or not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._start = trainer.global_step
        self._bar = tqdm(total=total, initial=self._start, desc="steps", unit="step", dynamic_ncols=True,
                         file=sys.stderr, smoothing=0.1, leave=True)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._bar is None or trainer.global_step % self.refresh_rate:
            return
        last = bool(trainer.max_steps) and 0 < trainer.max_steps <= trainer.global_step
        now = time.perf_counter()
        if now - self._shown < 0.5 and not last:          # at most two redraws a second
            return
        self._shown = now
        shown = {}
        for k, v in self.get_metrics(trainer, pl_module).items():
            if k in ("v_num",):
                continue
            try:
                shown[k.split("/")[-1]] = f"{float(v):.4g}"
            except (TypeError, ValueError):
                continue
        done = trainer.global_step - self._start
        if done:
            shown["s/step"] = f"{(time.perf_counter() - self._t0) / done:.2f}"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.n = trainer.global_step
        self._bar.refresh()
        if last:
            self.on_train_end(trainer, pl_module)     # close before Lightning's "stopped" line

    def on_validation_end(self, trainer, pl_module) -> None:
        """The held-out numbers of a validation inside `fit`, one line under the bar. (Lightning's
        `trainer.training` is False while it validates, and the last step's validation comes after the
        bar has closed, so neither decides.)"""
        if not self.is_enabled or not trainer.is_global_zero or trainer.state.fn != TrainerFn.FITTING:
            return
        vals = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if vals:
            line = "  step %d: %s" % (trainer.global_step, ", ".join(f"{k} {float(v):.4f}" for k, v in sorted(vals.items())))
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stderr)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
