"""The user's own inputs, read before jsonargparse parses them: objectives and engines that do not exist,
and config files that are not YAML.

`lit-ess` looks through the config files given with `--config` and the values given on the command line
for an objective or engine named by a class lit-ess does not have (`objective: PPO9000`, `grpo`), and
stops with one line that names the value and lists the classes there are; jsonargparse would say
"Expected a dot import path string: grpo". A config file that YAML cannot scan or parse is one line
naming the file, the line and the cause (a tab in the indentation by name), where jsonargparse says
`Problems parsing config: while scanning a plain scalar`. A flat key of the data module or the policy that
moved into a group (`data.prompts_per_rollout`, `model.lr`) is one line naming its new place (MOVED).
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import yaml

from lit_ess.engines import HFConfig, VLLMConfig, VLLMServerConfig
from lit_ess.objectives import OBJECTIVE_CLASSES

# the fields that take a class of ours: their module and the classes it has
FIELDS = {"objective": ("lit_ess.objectives", OBJECTIVE_CLASSES),
          "engine": ("lit_ess.engines", (VLLMConfig, VLLMServerConfig, HFConfig))}


# The knobs of RolloutDataModule and PolicyModule that moved into a group (datamodules/settings.py,
# lit_ess/settings.py): old flat key -> new key.
MOVED = {
    **{f"data.{k}": f"data.batch.{k}" for k in ("prompts_per_rollout", "samples_per_prompt", "steps_per_rollout",
                                                "steps_per_epoch")},
    **{f"data.{k}": f"data.schedule.{k}" for k in ("mode", "placement", "max_staleness", "worker_timeout")},
    "data.reward_timeout": "data.reward_limits.timeout", "data.max_reward_error_rate": "data.reward_limits.max_error_rate",
    "data.reward_in_worker": "data.reward_limits.in_worker",
    **{f"data.val_{k}": f"data.validation.{k}" for k in ("source", "prompts", "samples", "sampling")},
    **{f"model.{k}": f"model.optim.{k}" for k in ("lr", "weight_decay", "betas", "warmup_steps", "lr_schedule",
                                                 "min_lr_ratio", "max_grad_norm")},
    "model.micro_batch_size": "model.micro_batch.size", "model.micro_batch_tokens": "model.micro_batch.tokens",
    "model.packing": "model.micro_batch.packing", "model.model_dtype": "model.compute.dtype",
    **{f"model.{k}": f"model.compute.{k}" for k in ("gradient_checkpointing", "logprob_chunk", "disable_dropout")},
    "model.ess_alarm": "model.ess_alarm.threshold", "model.ess_alarm_error": "model.ess_alarm.error",
}
# the classes whose flat keys moved: a key of another class (SFTModule's model.lr) is its own
GROUPED = {"model": "PolicyModule", "data": "RolloutDataModule"}


def check_inputs(args: list[str]) -> str | None:
    """The first unknown objective or engine in the command line `args` or the config files they name, the
    first flat key that moved into a group (`moved`), or the first config file that is not YAML, as one line
    that says where it is and what to write instead; None when there is none."""
    try:
        inputs = list(_inputs(args))
    except ConfigSyntaxError as e:
        return str(e)
    for where, key, value in inputs:
        problem = _check(key, value)
        if problem:
            return where + problem
    return moved(inputs)


def moved(inputs: list[tuple[str, str, object]]) -> str | None:
    """'data.prompts_per_rollout is now data.batch.prompts_per_rollout' for the first key of the inputs (as
    `_inputs` yields them) that MOVED names, when the model or data class they configure is lit-ess's
    PolicyModule or RolloutDataModule (or not named); None when there is none."""
    keys: list[tuple[str, str, object]] = []

    def walk(where: str, key: str, value) -> None:
        keys.append((where, key, value))
        if isinstance(value, dict):
            for k, v in value.items():
                walk(where, f"{key}.{k}" if key else str(k), v)
    for where, key, value in inputs:
        walk(where, key.rstrip("+"), value)
    classes = {}
    for _, key, value in keys:              # the later one wins, as jsonargparse reads them
        parts = key.split(".")
        if parts[0] in GROUPED and (len(parts) == 1 and isinstance(value, str) or parts[1:] == ["class_path"]):
            classes[parts[0]] = value
    for where, key, value in keys:
        parts = [p for p in key.split(".") if p != "init_args"]
        short = ".".join(parts)
        root = parts[0] if parts else ""
        if short not in MOVED or str(classes.get(root, GROUPED.get(root))).rpartition(".")[2] != GROUPED.get(root):
            continue
        if short == "model.ess_alarm" and isinstance(value, dict):
            continue                       # the group itself
        dashes = "--" if where == "--" else ""
        return f"{where if not dashes else ''}{dashes}{short} is now {dashes}{MOVED[short]}"
    return None


def read_inputs(args: list[str]) -> list[tuple[str, object]]:
    """(dotted key, value) of each command-line option, and ("", content) of each --config file, as
    `check_inputs` reads them (a file that is not YAML: its text)."""
    try:
        return [(key, value) for _, key, value in _inputs(args)]
    except ConfigSyntaxError:
        return []


class ConfigSyntaxError(ValueError):
    """A config file that is not YAML: its file, line and cause (`_config_file`)."""


def _inputs(args: list[str]) -> Iterator[tuple[str, str, object]]:
    """(where, dotted key, value) for each --config file's content ("FILE: ", "", content) and each
    command-line option ("--", key, value), values read as YAML as jsonargparse reads them. What cannot
    be read is left for jsonargparse to report."""
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith("-"):
            continue                                  # the subcommand
        key, eq, value = arg.lstrip("-").partition("=")
        if not eq and i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        if key in ("c", "config"):
            if os.path.isfile(value):
                yield f"{value}: ", "", _config_file(value)
        else:
            yield "--", key, _yaml(value)


def _config_file(path: str) -> object:
    """The content of the config file `path`; a ConfigSyntaxError naming the file, the line and the cause
    when YAML cannot scan or parse it (jsonargparse says `Problems parsing config: while scanning ...`)."""
    with open(path) as f:
        text = f.read()
    try:
        return yaml.safe_load(text)
    except (yaml.scanner.ScannerError, yaml.parser.ParserError) as e:
        raise ConfigSyntaxError(_syntax_error(path, text, e)) from None
    except yaml.YAMLError:
        return text                                   # left for jsonargparse to report


def _syntax_error(path: str, text: str, error: yaml.MarkedYAMLError) -> str:
    """'FILE line L: cause', naming a tab in the indentation where one is at or before the error."""
    lines, mark = text.splitlines(), error.problem_mark
    near = [m.line for m in (mark, error.context_mark) if m is not None]
    tabs = [i for i in [*near, *range(max(near, default=0), -1, -1)] if i < len(lines) and
            "\t" in lines[i][:len(lines[i]) - len(lines[i].lstrip())]]
    if tabs:
        return (f"{path} line {tabs[0] + 1}: a tab in the indentation (YAML indents with spaces only): replace it "
                f"with spaces")
    context = f" ({error.context} at line {error.context_mark.line + 1})" if error.context and error.context_mark else ""
    return f"{path} line {mark.line + 1} column {mark.column + 1}: {error.problem}{context}"


def _yaml(text: str) -> object:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


# where lit-ess's own fields live (a key's parts without "init_args"): other keys of the same name (a
# user's source with an `engine` argument, a logger's `objective`) are not ours to judge
OURS = {("model", "objective"), ("data", "engine")}


def _ours(key: str) -> bool:
    parts = [p for p in key.rstrip("+").split(".") if p and p != "init_args"]
    if parts and parts[-1] == "class_path":
        parts = parts[:-1]
    return tuple(parts) in OURS


def _check(key: str, value) -> str | None:
    if isinstance(value, dict):
        return next(filter(None, (_check(f"{key}.{k}" if key else str(k), v) for k, v in value.items())), None)
    if isinstance(value, list):
        return next(filter(None, (_check(f"{key}.{i}", v) for i, v in enumerate(value))), None)
    if not isinstance(value, str):
        return None
    leaf = key.rpartition(".")[2].rstrip("+")
    field = key.split(".")[-2] if leaf == "class_path" and "." in key else leaf
    if field not in FIELDS or not _ours(key):
        return None
    module, classes = FIELDS[field]
    names = [c.__name__ for c in classes]
    mod, _, name = value.rpartition(".")
    if mod in ("", module) and name not in names and not os.path.exists(value):
        return (f"{key}: {value!r} is not a known {field}; choose one of {', '.join(names)} "
                f"(class_path {module}.NAME, or a class of your own by its import path)")
    return None
