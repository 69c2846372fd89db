"""ExportHF: save the trained policy as a Hugging Face folder (weights + tokenizer) at the end of fit.
With LoRA the folder holds the merged weights, and `adapter/` beside them the adapter (peft format).
The folder is written whole or not at all (lit_ess.checkpoint.atomic_folder)."""
from __future__ import annotations

from pathlib import Path

import lightning as L

from lit_ess.checkpoint import not_replaceable
from lit_ess.export import save_adapted, save_model
from lit_ess.lora import is_peft, merged_weights, peft_state


class ExportHF(L.Callback):
    """Save the trained policy as a Hugging Face folder at the end of fit.

    Args:
        dirpath: output folder; it can be used as `model_path` of a later run or by vLLM. None (default) =
            OUTPUT_DIR/model, the run's folder (`output_dir`, lit_ess.output_dir); without output_dir it must be given.
    """

    def __init__(self, dirpath: str | None = None):
        self.dirpath = None
        if dirpath is not None:
            self.set_dirpath(dirpath)

    def set_dirpath(self, dirpath: str) -> None:
        """Write to `dirpath`, refused now (not after the run) when replacing it would delete other files."""
        if (why := not_replaceable(Path(dirpath))) is not None:
            raise ValueError(f"ExportHF.dirpath={dirpath!r} {why}")
        self.dirpath = dirpath

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.dirpath is None:
            raise ValueError("ExportHF.dirpath is not set: give it a folder (or output_dir in a lit-ess config)")

    def on_train_end(self, trainer, pl_module) -> None:
        policy = pl_module.policy
        weights = merged_weights(policy) if is_peft(policy) else pl_module.policy_weights()
        state = {k: v.detach().cpu() for k, v in weights}   # every rank gathers (FSDP2)
        adapter = peft_state(policy) if is_peft(policy) else None
        if not trainer.is_global_zero:
            return
        if adapter is not None:
            save_adapted(policy, self.dirpath, pl_module.hparams.model_path, state, adapter)
            return
        save_model(policy, self.dirpath, pl_module.hparams.model_path, state_dict=state)
