"""What `lit-ess` says to its user besides the run: its own `--help`, the pointer at the top of `fit --help`,
the one line for `test`/`predict` (not offered), "did you mean" for a mistyped key or subcommand, the full
key of a class_path refused or of a missing argument of its class (jsonargparse names the last part), and the
block at the end of `fit` that says where the checkpoint, the exported model and the logs went.

Lightning's stock text describes a generic Trainer tool and lists every Trainer flag first (`fit --help`
is ~490 lines, the lit-ess knobs at its end); jsonargparse names a mistyped key without a suggestion
("Option 'lrr' is not accepted"), and Python's argparse a mistyped subcommand without one.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import typing
from pathlib import Path

from jsonargparse import DefaultHelpFormatter

SUBCOMMANDS = ("fit", "validate")
DOCS = "docs/quickstart.md and docs/configuration.md in the lit-ess repository (`mkdocs serve` there)"

HELP = f"""\
RL post-training of language models on PyTorch Lightning: vLLM (or transformers) samples, the trainer
learns with P3O (the batch's effective sample size in place of a clip range) or GRPO, DAPO, GSPO, CISPO,
decoupled PPO or REINFORCE. A run is one YAML config: the policy (model), the prompts, engine and reward
(data) and the Trainer.

First commands:
  lit-ess-tiny runs/demo/init                       build a tiny offline model (or use an HF model name)
  lit-ess fit --config configs/demo_sft.yaml        supervised warm start of the demo
  lit-ess fit --config configs/demo.yaml            RL with P3O; --ckpt_path last resumes it
  lit-ess fit --config configs/demo.yaml --print_config     every knob with its value

A run writes into its output_dir (checkpoints/, logs/, model/); fit into one that holds a run refuses
unless given --ckpt_path last (resume) or --overwrite true (start over).
Then: lit-ess validate --config CONFIG --ckpt_path last (held-out metrics of the run's newest checkpoint),
lit-ess-export CKPT DIR (a Hugging Face folder).
Docs: {DOCS}."""

FIT_HELP = """\
Train: RL (lit_ess.module.PolicyModule with lit_ess.datamodules.RolloutDataModule) or SFT (lit_ess.sft.SFTModule
with lit_ess.datamodules.SFTDataModule), as the config's class_path says.

The lit-ess knobs:
  --model.help PolicyModule         the policy: model_path, objective, lr, micro-batches, LoRA, ...
  --data.help RolloutDataModule     prompts (source), engine, sampling, reward, batch shape, async mode
  --print_config                    the whole config with every value (after --config and other flags)
  --output_dir DIR                  the run's folder: checkpoints/, logs/, model/ (--ckpt_path last resumes
                                    a run there, --overwrite true starts it over)
  --model.init_args.KEY VALUE       set one, e.g. --model.init_args.optim.lr 1e-4, --data.init_args.reward KEY
Lightning's Trainer flags (--trainer.*) follow below; the lit-ess knobs are under --model and --data."""

# the one-line help of each subcommand in `lit-ess --help` (Lightning's are the Trainer methods' docstrings)
SUMMARY = {"fit": "train (RL or SFT) as the config says; --ckpt_path last resumes",
           "validate": "held-out metrics of a checkpoint (--ckpt_path CKPT, or last: the run's newest)"}

VALIDATE_HELP = """\
Held-out metrics (val/pass@k, val/reward_mean) of a checkpoint: --config CONFIG --ckpt_path CKPT, or --ckpt_path
last for the newest checkpoint of the config's output_dir (the run's folder); the prompts come from
data.validation.source. --model.help PolicyModule and --data.help RolloutDataModule list the knobs."""

NOT_OFFERED = {
    "test": "`lit-ess test` is not offered (the policy has no test step): held-out metrics come from "
            "`lit-ess validate --config CONFIG --ckpt_path CKPT` with data.validation.source",
    "predict": "`lit-ess predict` is not offered: export the policy (`lit-ess-export CKPT DIR`) and sample from DIR "
               "with vLLM or transformers, or run `lit-ess validate --config CONFIG --ckpt_path CKPT`",
}


class Formatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, with descriptions printed as written (their line breaks kept)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def parser_kwargs() -> dict:
    """LightningCLI's parser_kwargs: our description for the command and for each subcommand, the
    subcommands' usage line short (argparse would list all ~60 options first)."""
    usage = "%(prog)s --config CONFIG [--KEY VALUE ...] [--print_config]"
    return {"prog": "lit-ess", "description": HELP, "formatter_class": Formatter,
            "fit": {"description": FIT_HELP, "usage": usage, "formatter_class": Formatter},
            "validate": {"description": VALIDATE_HELP, "usage": usage + " [--ckpt_path CKPT]",
                         "formatter_class": Formatter}}


def not_offered(args: list[str]) -> str | None:
    """The one line for a subcommand lit-ess lists no more (`test`, `predict`), else None."""
    return NOT_OFFERED.get(_first_word(args) or "")


def _first_word(args: list[str]) -> str | None:
    """The subcommand: the first argument that is neither an option nor the value of -c/--config."""
    i = 0
    while i < len(args):
        if args[i] in ("-c", "--config"):
            i += 2
            continue
        if not args[i].startswith("-"):
            return args[i]
        i += 1
    return None


# ------------------------------------------------------------------ did you mean
def did_you_mean(message: str, inputs: dict[str, object]) -> str:
    """`message` (a parse error of jsonargparse or argparse) with "; did you mean KEY?" when the unknown key
    or subcommand it names is close to a known one (no subcommand at all: a pointer to --help).
    inputs: the user's keys (dotted, from the config files and the command line, `flat_inputs`) with
    their values, to find where a key sits and which class it belongs to."""
    if re.search(r'"subcommand" .* not provided', message):
        return f"{message.rstrip('.')}: `lit-ess --help` says what to run first"
    if m := re.search(r"invalid choice: '([^']*)'", message):
        hint = _close(m.group(1), [*SUBCOMMANDS, *NOT_OFFERED])
        return f"{message}; did you mean '{hint}'?" if hint in SUBCOMMANDS else message
    m = (re.search(r"accept option '([^']+)'", message) or re.search(r"unrecognized arguments: --([^\s=]+)", message)
         or re.search(r"Option '([^']+)' is not accepted", message))
    if m is None:
        return message
    name = m.group(1)                  # the whole key, or its end (jsonargparse names the part it got to)
    paths = [k for k in inputs if k == name or k.endswith(f".{name}")] or [name]
    for refused_only in (True, False):       # first the keys no class takes (model.dtype beside data.engine.dtype)
        for path in paths:
            parent, _, leaf = path.rpartition(".")
            cls = _class_at(parent, inputs) if parent else None
            if refused_only and leaf in _parameters(cls):
                continue
            if hints := _hints(leaf, cls, parent, inputs):
                at = _canonical(parent, inputs)
                return f"{message}; did you mean {' or '.join(f'{at}.{h}' for h in hints)}?"
    return message


def _canonical(path: str, inputs: dict[str, object]) -> str:
    """`path` with `init_args` only after a key given a class by class_path (model.init_args.optim.init_args ->
    model.init_args.optim: a plain group takes its fields directly)."""
    out, seen = [], []
    for part in path.split("."):
        if part != "init_args":
            seen.append(part)
        if part != "init_args" or (seen and _class_path(inputs, seen) is not None):
            out.append(part)
    return ".".join(out)


def _hints(leaf: str, cls, parent: str, inputs: dict[str, object]) -> list[str]:
    """The keys of `cls` (at the dotted `parent`) closest to `leaf` (difflib, 0.6 at least): its own parameters,
    then the fields of its grouped settings (a parameter typed as a dataclass, or given one by class_path: `optim.lr`,
    `objective.init_args.ess_cap` of the objective chosen, for a key typed without its group); a field that two
    groups have gives both (`dynamic_sampling.enable`, `overlong.enable`)."""
    keys: dict[str, list[str]] = {name: [name] for name in _parameters(cls)}
    for name in list(keys):
        where = [p for p in f"{parent}.{name}".split(".") if p != "init_args"]
        given = _import(_class_path(inputs, where) or "")
        given = given if inspect.isclass(given) else None
        default = _default(cls, name)
        group = given or (type(default) if dataclasses.is_dataclass(default) else _annotated_class(cls, name))
        if dataclasses.is_dataclass(group):
            at = f"{name}.init_args" if given else name
            at_key = ".".join(where)
            on = any(v is not None and (k == at_key or k.startswith(f"{at_key}."))    # the user set it: on already
                     for k, v in ((key.replace(".init_args", ""), v) for key, v in inputs.items()))
            off = f" (this turns {name} on: it is null by default)" if default is None and not on else ""
            for f in dataclasses.fields(group):
                if f.name not in keys or keys[f.name][0] != f.name:        # an own parameter's name stays its own
                    keys.setdefault(f.name, []).append(f"{at}.{f.name}{off}")
    best = _close(leaf, keys)
    return keys[best] if best else []


def full_key(message: str, inputs: dict[str, object]) -> str:
    """`message` with the full key where jsonargparse names only the last part of a key inside a class
    given by class_path: 'Parser key "env": WHY' as 'data.init_args.env.env: WHY' when one class_path
    the user gave is under a key that ends so (or one that the message quotes), and argparse's "the following arguments are required: NAME" as
    "KEY is required (CLASS has no default for it)" for an argument of such a class (an environment, a
    prompt source). inputs: the user's keys with their values (`flat_inputs`)."""
    if m := re.match(r'Parser key "([\w.]+)": ', message):
        keys = [k for k in inputs if k.endswith(f".{m.group(1)}.class_path") and isinstance(inputs[k], str)]
        keys = [k for k in keys if f"'{inputs[k]}'" in message] or keys       # the one the message quotes
        return f"{keys[0].removesuffix('.class_path')}: {message[m.end():]}" if len(keys) == 1 else message
    m = re.fullmatch(r"the following arguments are required: ([\w, ]+)", message.strip())
    if m is None:
        return message
    names = [n.strip() for n in m.group(1).split(",")]
    for key, value in inputs.items():
        prefix, _, last = key.rpartition(".")
        if last != "class_path" or not isinstance(value, str):
            continue
        try:
            params = inspect.signature(_import(value)).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.name in names and p.default is p.empty and f"{prefix}.init_args.{p.name}" not in inputs:
                return f"{prefix}.init_args.{p.name} is required ({value} has no default for it)"
    return message


def _close(word: str, choices) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def flat_inputs(sources: list[tuple[str, object]]) -> dict[str, object]:
    """{dotted key: value} of (key, value) pairs whose values may be nested dicts (a config file's content
    under the key "")."""
    flat: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        flat.pop(prefix, None)                        # given again later: the later one wins, and comes last
        flat[prefix] = value
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
    for key, value in sources:
        walk(key.rstrip("+"), value)
    flat.pop("", None)
    return flat


ROOTS = {"trainer": "lightning.pytorch.Trainer"}
SHORT = ("lit_ess.module", "lit_ess.sft", "lit_ess.datamodules", "lit_ess.callbacks", "lit_ess.objectives",
         "lit_ess.engines", "lit_ess.envs", "lit_ess.advantages", "lightning.pytorch.callbacks", "lightning.pytorch.loggers")


def _class_at(path: str, inputs: dict[str, object]):
    """The class whose arguments the dotted `path` holds (`model.init_args` -> the model's class,
    `data.init_args.sampling` -> SamplingConfig), from the class_path the user gave or a parameter's type;
    None when it cannot be told."""
    parts = [p for p in path.split(".") if p != "init_args"]
    cls, seen = None, []
    for part in parts:
        seen.append(part)
        given = _class_path(inputs, seen)
        if given is not None:
            cls = _import(given)
        elif not seen[:-1]:
            cls = _import(ROOTS.get(part, ""))
        else:
            cls = _annotated_class(cls, part)
        if cls is None:
            return None
    return cls


def _class_path(inputs: dict[str, object], parts: list[str]) -> str | None:
    """The class_path the user gave for the key `parts` (with or without init_args between), if any."""
    for key, value in reversed(inputs.items()):      # the last given wins, as in jsonargparse
        keyed = [p for p in key.split(".") if p != "init_args"]
        if keyed == [*parts, "class_path"] and isinstance(value, str):
            return value
        if keyed == parts and isinstance(value, str) and re.fullmatch(r"[\w.]+", value):
            return value            # --model PolicyModule, objective: GRPO
    return None


def _import(name: str):
    if not name:
        return None
    candidates = [name] if "." in name else [f"{m}.{name}" for m in SHORT]
    for dotted in candidates:
        module, _, attr = dotted.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except Exception:             # noqa: BLE001 -- not importable (or failing as it imports): no class to name
            continue
    return None


def _annotated_class(owner, name: str):
    """The class a parameter `name` of `owner` is typed as (Optional/Union: its first class), or None."""
    if owner is None:
        return None
    try:
        hints = typing.get_type_hints(owner.__init__)
    except Exception:                 # noqa: BLE001 -- a hint that does not resolve: no suggestion
        return None
    todo = [hints.get(name)]
    while todo:
        hint = todo.pop(0)
        if inspect.isclass(hint) and hint.__module__ != "builtins":
            return hint
        todo += list(typing.get_args(hint))
    return None


def _default(cls, name: str):
    """The default of `cls`'s parameter `name` (inspect's `empty` when it has none or cannot be read)."""
    try:
        return inspect.signature(cls).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return inspect.Parameter.empty


def _parameters(cls) -> list[str]:
    if cls is None:
        return []
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# ------------------------------------------------------------------ end of fit
def wrap_up(trainer, checkpoints: list[Path], exports: list[str], output_dir: str | None = None) -> str:
    """The block printed when `fit` ends: the run's folder (output_dir, when the config names one), where the
    newest checkpoint, the exported model and the logs are (paths under the current folder relative to it,
    as configs give them)."""
    rows = [("run", f"{_shown(output_dir)}  (fit it again: --ckpt_path last resumes, --overwrite true starts over)")] \
        if output_dir else []
    rows += [("checkpoint", f"{_shown(checkpoints[0])}  (resume: --ckpt_path last)" if checkpoints else
             "none written (add a ModelCheckpoint to trainer.callbacks)")]
    rows += [("model", f"{_shown(d)}  (Hugging Face folder: model_path of a later run, or vLLM)") for d in exports] or \
        [("model", "not exported (lit_ess.callbacks.ExportHF, or lit-ess-export CKPT DIR)")]
    for lg in trainer.loggers:
        folder = getattr(lg, "log_dir", None) or getattr(lg, "save_dir", None)
        if folder:
            how = f"  (tensorboard --logdir {_shown(folder)})" if type(lg).__name__ == "TensorBoardLogger" else ""
            rows.append(("logs", f"{_shown(folder)}{how}"))
    if not trainer.loggers:
        rows.append(("logs", "none (trainer.logger)"))
    return "\n".join([f"lit-ess: fit done at step {trainer.global_step}:"] + [f"  {k:<12}{v}" for k, v in rows])


def _shown(path) -> str:
    """`path` relative to the current folder when it lies under it, else absolute."""
    full = Path(path).resolve()
    return str(full.relative_to(Path.cwd().resolve())) if full.is_relative_to(Path.cwd().resolve()) else str(full)

