"""`lit-ess`: LightningCLI for RL (PolicyModule + RolloutDataModule) and the SFT warm start.

    lit-ess fit --config configs/demo.yaml
    lit-ess fit --config configs/demo.yaml --ckpt_path last        # resume from the checkpoint folder
    lit-ess fit --config configs/demo.yaml --print_config          # every knob with its default
    lit-ess fit --config configs/demo.yaml --model.init_args.objective GRPO --model.init_args.objective.clip_eps 0.3

The model and data classes are chosen in the config (`class_path`): lit_ess.module.PolicyModule with
lit_ess.datamodules.RolloutDataModule for RL, lit_ess.sft.SFTModule with lit_ess.datamodules.SFTDataModule for SFT.
Objectives (lit_ess.objectives.P3O, GRPO, ...) and engines (lit_ess.engines.VLLMConfig, HFConfig) are
typed configs too. `model_path` is linked from the model to the data module. The Trainer defaults to
`max_epochs: -1` (stop on `max_steps`) and a one-line progress bar over optimizer steps
(lit_ess.callbacks.StepProgressBar).

A bad value prints one line that names it and exits with status 2 (LIT_ESS_TRACEBACK=1 for the
traceback). The console is quiet: LIT_ESS_VERBOSE=1 shows every library warning and log line.

Note (upstream LightningCLI behaviour): with `--ckpt_path FILE`, hyper-parameters saved in the
checkpoint override those given on the command line for the model.
"""
from __future__ import annotations

import os
import re
import sys

from lit_ess.console import quiet_console

quiet_console()            # before Lightning, transformers and vLLM are imported

from jsonargparse import set_parsing_settings  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from lightning.pytorch.callbacks import ModelSummary, ProgressBar  # noqa: E402

import lit_ess.callbacks  # noqa: E402,F401  (registers the classes for short names in configs)
import lit_ess.datamodules  # noqa: E402,F401
import lit_ess.module  # noqa: E402,F401
import lit_ess.sft  # noqa: E402,F401
from lit_ess.callbacks import ModelSummary as LitESSModelSummary, StepProgressBar  # noqa: E402
from lit_ess.engines import EngineConfig  # noqa: E402
from lit_ess.objectives import OBJECTIVES, Objective  # noqa: E402

# objectives and engine configs are dataclasses: let `class_path` pick any subclass
set_parsing_settings(subclasses_enabled=[Objective, EngineConfig])

# the configs of lit-ess < 0.2 named objectives and engines by string; say how to write them now
LEGACY = {
    "objective_kwargs": "objective_kwargs is gone: give the objective as `objective: {class_path: "
                        "lit_ess.objectives.GRPO, init_args: {clip_eps: 0.2}}` (or --model.init_args.objective GRPO)",
    "engine_kwargs": "engine_kwargs is gone: give the engine as `engine: {class_path: lit_ess.engines.VLLMConfig, "
                     "init_args: {dtype: bfloat16, vllm_kwargs: {...}}}` (or HFConfig)",
}
OBJECTIVE_CLASSES = {name: cls.__name__ for name, cls in OBJECTIVES.items()}


class _Parser(LightningArgumentParser):
    """Parse errors as one line that names the culprit, no usage block and no Namespace dump."""

    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get("LIT_ESS_TRACEBACK"):
            return super().error(message, ex)
        _fail(_explain(message))


_NOISE = re.compile(r"^(Does not validate|Subtypes:|Errors:|Given value|Expected a <class 'NoneType'>|"
                    r"Problem with given class_path|Subclass types expect|Parser key|Unable to load config|"
                    r"Not a valid subclass|Import path)")
_CHOICES = {"objective": ("lit_ess.objectives", [c.__name__ for c in OBJECTIVES.values()]),
            "engine": ("lit_ess.engines", ["VLLMConfig", "HFConfig"])}


def _explain(message: str) -> str:
    """One line from a jsonargparse error: the culprit's own sentence first, no usage, no Namespace dump."""
    for key, hint in LEGACY.items():
        if re.search(rf"\b{key}\b", message):
            return hint
    keys = re.findall(r'(?:Parser key|Key) "([^"]+)"', message)
    key = keys[-1] if keys else ""
    for field, (module, names) in _CHOICES.items():
        bad = re.search(r"(?:dot import path string|Unable to load config)[:\s'\"]+([\w.]+)", message)
        missing = re.search(rf"module '{re.escape(module)}' has no attribute '(\w+)'", message)
        if missing:
            key, bad = key or field, missing
        if key.split(".")[-1] == field and bad:
            value = bad.group(1)
            if value in OBJECTIVE_CLASSES or value in ("vllm", "hf"):
                new = OBJECTIVE_CLASSES.get(value) or ("VLLMConfig" if value == "vllm" else "HFConfig")
                return f"{key}: {value!r} is the old string form; write `{field}: {{class_path: {module}.{new}}}`"
            return f"{key}: {value!r} is not a known {field}; choose one of {', '.join(names)} (class_path {module}.NAME)"
    lines = [ln.strip().lstrip("-").strip() for ln in message.splitlines()]
    lines = [ln for ln in lines if ln and not _NOISE.match(ln) and "Namespace(" not in ln]
    ours = [ln for ln in lines if re.search(r"\bmust\b|is not one of|\(got |no such|is empty", ln)]
    reason = re.sub(r"^(ValueError|TypeError):\s*", "", (ours or lines or [message.strip()])[0])
    return f"{key}: {reason}" if key and key.split(".")[-1] not in reason else reason


def _fail(message: str) -> None:
    print(f"lit-ess: error: {message}\n(set LIT_ESS_TRACEBACK=1 for the traceback)", file=sys.stderr)
    sys.exit(2)


class LitESSCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.model_path", "data.init_args.model_path")
        parser.set_defaults({"trainer.max_epochs": -1,
                             "trainer.num_sanity_val_steps": 0})

    def _instantiate_trainer(self, config, callbacks):
        """Add the step progress bar and lit-ess's model summary unless the config brings its own or turns
        them off."""
        given = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, StepProgressBar()]
        if config.get("enable_model_summary", True) is not False and not any(isinstance(c, ModelSummary) for c in given):
            callbacks = [*callbacks, LitESSModelSummary()]
            config["enable_model_summary"] = False     # Lightning's default summary stays out, and its notice
        return super()._instantiate_trainer(config, callbacks)


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                  save_config_kwargs={"overwrite": True}, args=args, auto_configure_optimizers=False)
    except (ValueError, FileNotFoundError, OSError) as e:   # bad config or input: one clear line, exit 2
        if os.environ.get("LIT_ESS_TRACEBACK"):
            raise
        _fail(_explain(str(e)) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
