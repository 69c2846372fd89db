"""`lit-ess`: LightningCLI for RL (PolicyModule + RolloutDataModule) and the SFT warm start.

    lit-ess fit --config configs/demo.yaml
    lit-ess fit --config configs/demo.yaml --ckpt_path last        # resume from the checkpoint folder
    lit-ess fit --config configs/demo.yaml --print_config

The model and data classes are chosen in the config (`class_path`): lit_ess.module.PolicyModule with
datamodules.RolloutDataModule for RL, lit_ess.sft.SFTModule with datamodules.SFTDataModule for SFT. `model_path` is linked from the model to the data module. The Trainer defaults to
`reload_dataloaders_every_n_epochs: 1` (each epoch is one rollout phase) and `max_epochs: -1` (stop on
`max_steps`).

Note (upstream LightningCLI behaviour): with `--ckpt_path FILE`, hyper-parameters saved in the
checkpoint override those given on the command line for the model.
"""
from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

import callbacks  # noqa: F401  (registers the classes for short names in configs)
import datamodules  # noqa: F401
import lit_ess.module  # noqa: F401
import lit_ess.sft  # noqa: F401


class LitESSCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.model_path", "data.init_args.model_path")
        parser.set_defaults({"trainer.reload_dataloaders_every_n_epochs": 1, "trainer.max_epochs": -1,
                             "trainer.num_sanity_val_steps": 0})


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if args is None else args
    try:
        LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True,
                  save_config_kwargs={"overwrite": True}, args=argv, auto_configure_optimizers=False)
    except (ValueError, FileNotFoundError, OSError) as e:   # bad config or input: one clear line, exit 2
        if os.environ.get("LIT_ESS_TRACEBACK"):
            raise
        print(f"lit-ess: error: {type(e).__name__}: {e}\n(set LIT_ESS_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
