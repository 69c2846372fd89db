"""`lit-ess`: LightningCLI for RL (PolicyModule + RolloutDataModule) and the SFT warm start.

    lit-ess fit --config configs/demo.yaml
    lit-ess fit --config configs/demo.yaml --ckpt_path last        # resume from the checkpoint folder
    lit-ess fit --config configs/demo.yaml --print_config          # every knob with its default
    lit-ess fit --config configs/demo.yaml --model.init_args.objective GRPO --model.init_args.objective.clip_eps 0.3

The model and data classes are chosen in the config (`class_path`): lit_ess.module.PolicyModule with
lit_ess.datamodules.RolloutDataModule for RL, lit_ess.sft.SFTModule with lit_ess.datamodules.SFTDataModule for SFT.
Objectives (lit_ess.objectives.P3O, GRPO, ...) and engines (lit_ess.engines.VLLMConfig, HFConfig) are
typed configs too. `model_path` is linked from the model to the data module. The Trainer defaults to
`max_epochs: -1` (stop on `max_steps`), a one-line progress bar over optimizer steps
(lit_ess.callbacks.StepProgressBar) and Lightning's model summary without its uncounted FLOPs
(lit_ess.callbacks.ModelSummary).

A bad value prints one line that names it and exits with status 2 (LIT_ESS_TRACEBACK=1 for the
traceback). An objective or engine lit-ess does not have, and a config file that is not YAML, are
refused before parsing, naming the file and the key (lit_ess/config_check.py). A mistyped key or
subcommand gets "did you mean"; `lit-ess --help` and the top of `fit --help` are lit-ess's own, `test`
and `predict` are not offered, and `fit` ends with where its checkpoint, export and logs went
(lit_ess/guide.py). The console is quiet: LIT_ESS_VERBOSE=1 shows every library warning and log line.

Checkpoints are written atomically and `--ckpt_path last` resumes from the newest readable one,
saying so in one line when it passes over a torn one (lit_ess/checkpoint.py).

Stopping. Ctrl-C and SIGTERM stop the run the same way: every rank, rollout worker and reward worker
ends with it (lit_ess/lifetime.py), and one line says where the last checkpoint is. A rank whose
collective fails because another rank died says which rank died, not the backend's error; a rank whose
launcher died says so and exits.

Exit (`run`). The command exits as the interpreter does (its threads waited for, every atexit handler
run, the ranks it launched ended, open files flushed or closed), less the teardown of the imported
torch, transformers, Lightning and vLLM, which took 5-7 s of every `lit-ess fit` of a tiny model on this
2-core machine under load. Cleanup that only `__del__` does (an unclosed zip archive, a temporary file,
a profiler's output under `python -m cProfile`) does not run: LIT_ESS_FULL_EXIT=1 keeps the whole exit.
`main` is the command without it, for callers that keep their process.

One folder per run (lit_ess/output_dir.py): `output_dir` names the run's folder once; its checkpoints, logs and
exported model follow it unless the config sets those paths itself. `fit` into a folder that already holds a run
refuses in one line unless told to resume (`--ckpt_path last`: that folder's newest checkpoint) or to start over
(`--overwrite true`: the old run's folders there are removed first); `validate --ckpt_path last` loads the newest
checkpoint of the run the config points at.

Resume (`--ckpt_path last` or a path): the config's knobs are the run's. LightningCLI would merge a
checkpoint file's model hyper-parameters over the config (not for `last`); lit-ess does not, and refuses in
one line a resume whose model knobs differ from the checkpoint's, naming each (`_check_checkpoint`).
"""
from __future__ import annotations

import atexit
import gc
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

from lit_ess.console import quiet_console

quiet_console()            # before Lightning, transformers and vLLM are imported

from jsonargparse import set_parsing_settings  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, ProgressBar  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402

import lit_ess.callbacks  # noqa: E402,F401  (registers the classes for short names in configs)
import lit_ess.datamodules  # noqa: E402,F401
import lit_ess.module  # noqa: E402,F401
import lit_ess.sft  # noqa: E402,F401
from lit_ess.callbacks import ModelSummary as LitESSModelSummary, StepProgressBar  # noqa: E402
from lit_ess.checkpoint import (AtomicCheckpointIO, candidates, lock_folder, resolve_resume, resume_changes,  # noqa: E402
                                saved_settings)
from lit_ess.config_check import check_inputs, read_inputs  # noqa: E402
from lit_ess.datamodules import RolloutDataModule  # noqa: E402
from lit_ess.engines import EngineConfig, EngineFault  # noqa: E402
from lit_ess.engines.vllm_server import SHARED_ADAPTERS  # noqa: E402
from lit_ess.model_path import check_checkpoint  # noqa: E402
from lit_ess.objectives import Objective  # noqa: E402
from lit_ess.output_dir import MARKER, OUTPUT_DIR_HELP, OVERWRITE_HELP, follow, follow_callbacks, refusal, run_of  # noqa: E402
from lit_ess.guide import SUMMARY, did_you_mean, flat_inputs, full_key, not_offered, parser_kwargs, wrap_up  # noqa: E402
from lit_ess.health import ESSAlarmError, NonFiniteError  # noqa: E402
from lit_ess.lifetime import Peers, alive, die_with_parent, node_rank  # noqa: E402
from lit_ess.rewards import add_search_folders  # noqa: E402
from lit_ess.rollout import Placement, RankFailed, WorkerError  # noqa: E402

# objectives and engine configs are dataclasses: let `class_path` pick any subclass
set_parsing_settings(subclasses_enabled=[Objective, EngineConfig])


class _Parser(LightningArgumentParser):
    """Parse errors as one line that names the culprit, no usage block and no Namespace dump; a mistyped
    key or subcommand gets "did you mean" (lit_ess.guide), found from the user's inputs (`args`)."""

    args: list[str] = []

    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get("LIT_ESS_TRACEBACK"):
            return super().error(message, ex)
        inputs = flat_inputs(read_inputs(_Parser.args))
        _fail(did_you_mean(full_key(_explain(ex, message), inputs), inputs))


def _explain(error: BaseException | None, message: str = "") -> str:
    """One line for a failed parse or build: where it failed, in the first line of jsonargparse's message
    (`Parser key "sampling.temperature":`), and why, in the words of the code that raised first.
    jsonargparse chains each wrapper (nested keys, the alternatives of a union) to the error it wraps
    with `raise ... from`, so the innermost cause is the check that failed: a dataclass's __post_init__
    or a constructor, which names its own field, or jsonargparse's own type check. A union (a field that
    takes a name or a class: `env`, `advantage`) given a class_path chains only to its plain branch
    ("Expected a <class 'str'>"): the reason is the class branch's, read from the union's list of errors."""
    why = ""
    while error is not None:
        text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
        if why := _class_branch(text):
            break
        if error.__cause__ is None:
            why = _first_line(text)
            break
        error = error.__cause__
    where = _first_line(message)
    if why and why not in where:
        return f"{where} {why}".strip()
    return where or "invalid arguments"


def _class_branch(text: str) -> str:
    """The reason of a union's class branch when a class_path (a mapping) failed them all, on one line:
    jsonargparse lists each branch's error under "Errors:" as "- ...", continued on indented lines; the
    plain branches say "Expected a <class 'str'>" or "Expected a typing.Literal[...]". "" when `text` is
    not such a union error."""
    if not text.startswith("Does not validate against any of the Union subtypes") or \
            "Given value type: <class 'dict'>" not in text:
        return ""
    items, inside = [], False
    for line in text.splitlines():
        if line.startswith("Errors:"):
            inside = True
        elif inside and line.startswith("  - "):
            items.append(line[4:].strip())
        elif inside and line.startswith("    ") and items:
            items[-1] += " " + line.strip()
        elif inside:
            break
    reasons = [i for i in items if not re.match(r"Expected a (<class '|typing\.Literal\[)", i)]
    return reasons[0].partition(". Got value:")[0] if reasons else ""


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _fail(message: str, traceback: bool = True, code: int = 2) -> None:
    print(f"lit-ess: error: {message}", file=sys.stderr)
    if traceback:
        print("(set LIT_ESS_TRACEBACK=1 for the traceback)", file=sys.stderr)
    sys.exit(code)


class _StopNotice(Callback):
    """Gathers the ranks' pids when the run starts (lit_ess.lifetime.Peers); on Ctrl-C or SIGTERM, rank 0
    says in one line where the last checkpoint is."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        Peers.record()

    def on_train_start(self, trainer, pl_module) -> None:
        """Lightning's SIGTERM handler (installed at fit start) broadcasts from rank 0, which waits for ever
        when the other ranks are stopping too: ours (`_stop_on_sigterm`) takes its place."""
        if _SIGTERM[0] is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _SIGTERM[0])

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, (KeyboardInterrupt, SIGTERMException)) or not trainer.is_global_zero:
            return
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        found = candidates(dirs, _hpc_checkpoints(trainer))
        where = (f"last checkpoint: {found[0]}" if found else
                 f"no checkpoint in {', '.join(map(str, dirs))} yet" if dirs else "no checkpoint folder (ModelCheckpoint)")
        print(f"lit-ess: stopped at step {trainer.global_step} (Ctrl-C or SIGTERM); {where}", file=sys.stderr)


def _hpc_checkpoints(trainer) -> list[Path]:
    """The checkpoints Lightning's Slurm requeue path writes (default_root_dir/hpc_ckpt_N.ckpt)."""
    return sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))


class _Requeue(Callback):
    """Slurm preemption, at a step boundary. Under srun Lightning's SLURMEnvironment requeues the job on
    SIGUSR1 (`sbatch --signal=SIGUSR1@T`), but its handler saves the checkpoint inside the signal handler:
    mid-step (the step's batch is out of the rollout buffer, its update not in the weights: a resume loses
    it), and on each rank wherever the signal finds it (a rank still in a collective and another in the
    checkpoint's all_gather would not match). Here the signal only marks the run; at the end of the step under way the ranks
    agree (one all-reduce per step), save Lightning's HPC checkpoint (default_root_dir/hpc_ckpt_N.ckpt,
    which `--ckpt_path last` and a requeued `fit` without --ckpt_path both resume from), rank 0 runs
    `scontrol requeue`, and every rank waits for the SIGTERM with which Slurm ends the job (a stop, as
    Ctrl-C). A failed requeue is one line and the run goes on."""

    def __init__(self, signum: int):
        self.signum, self.signalled = signum, False
        signal.signal(signum, self._mark)

    def _mark(self, signum, frame) -> None:
        self.signalled = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        if not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        self.signalled = False
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path, weights_only=False)
        error = None
        if trainer.is_global_zero:
            job = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
                   if "SLURM_ARRAY_JOB_ID" in os.environ else os.environ.get("SLURM_JOB_ID", "?"))
            name = signal.Signals(self.signum).name
            print(f"lit-ess: preempted ({name}) at step {trainer.global_step}: checkpoint {path}; "
                  f"scontrol requeue {job}", file=sys.stderr, flush=True)
            try:
                res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
                error = None if res.returncode == 0 else _first_line(res.stderr) or f"exit status {res.returncode}"
            except (OSError, subprocess.TimeoutExpired) as e:
                error = str(e)
            if error:
                print(f"lit-ess: error: scontrol requeue {job} failed ({error}): the run goes on; "
                      f"resume it later with --ckpt_path last", file=sys.stderr, flush=True)
        if trainer.strategy.broadcast(error) is None:
            time.sleep(300)               # Slurm's SIGTERM ends this (KeyboardInterrupt, _stop_on_sigterm)
            if trainer.is_global_zero:
                print("lit-ess: error: no SIGTERM 300 s after the requeue: the run goes on", file=sys.stderr, flush=True)


class LitESSCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit and validate: the policy has no test or predict step (lit_ess.guide.NOT_OFFERED)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        """Lightning's parser, with lit-ess's one-line summary of each subcommand in `lit-ess --help`."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        for action in self.parser._actions:
            for choice in getattr(action, "_choices_actions", []):
                choice.help = SUMMARY.get(choice.dest, choice.help)

    def add_default_arguments_to_parser(self, parser) -> None:
        """seed_everything (Lightning's), then output_dir: the run's folder (lit_ess.output_dir)."""
        super().add_default_arguments_to_parser(parser)
        parser.add_argument("--output_dir", type=Optional[str], default=None, help=OUTPUT_DIR_HELP)

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        """fit also takes --overwrite true: start over in an output_dir that holds a run."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "fit":
            parser.add_argument("--overwrite", type=bool, default=False, help=OVERWRITE_HELP)
        return parser

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.init_args.model_path", "data.init_args.model_path")
        parser.set_defaults({"trainer.max_epochs": -1,
                             "trainer.num_sanity_val_steps": 0})

    def before_instantiate_classes(self) -> None:
        """The paths the config leaves unset follow output_dir (lit_ess.output_dir.follow). config.yaml keeps
        the config as given (those paths unset, so it reruns with another output_dir; --overwrite off)."""
        cfg = self.config.get(str(self.subcommand), self.config)
        self.output_dir = cfg.get("output_dir")
        self._given = cfg.clone()
        if "overwrite" in self._given:
            self._given["overwrite"] = False
        follow(cfg, self.output_dir)

    def _instantiate_trainer(self, config, callbacks):
        """Add the step progress bar and lit-ess's model summary unless the config brings its own or turns
        them off, and write checkpoints atomically (lit_ess.checkpoint) unless the config brings its own
        CheckpointIO. ModelCheckpoint and ExportHF without a dirpath write into output_dir; LightningCLI's
        config.yaml is the config as given, and `validate` writes none (the run's own stays)."""
        given = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, StepProgressBar()]
        if config.get("enable_model_summary", True) is not False and not any(isinstance(c, ModelSummary) for c in given):
            callbacks = [*callbacks, LitESSModelSummary()]
            config["enable_model_summary"] = False     # Lightning's default summary stays out, and its notice
        callbacks = [*callbacks, _StopNotice()]
        trainer = super()._instantiate_trainer(config, callbacks)
        follow_callbacks(trainer, getattr(self, "output_dir", None))
        for cb in [cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)]:
            if self.subcommand == "validate":
                trainer.callbacks.remove(cb)
            elif getattr(self, "_given", None) is not None:
                cb.config = self._given
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        env = trainer._accelerator_connector.cluster_environment
        if (isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None
                and threading.current_thread() is threading.main_thread()
                and signal.getsignal(env.requeue_signal) in (None, signal.SIG_DFL)):   # as Lightning: a handler of the user's stays
            env.auto_requeue = False          # Lightning's handler stays out: _Requeue takes its place
            trainer.callbacks.append(_Requeue(env.requeue_signal))
        return trainer

    def _parse_ckpt_path(self) -> None:
        """A torn checkpoint named by --ckpt_path is one line. LightningCLI's own step (merging a checkpoint
        file's hyper-parameters over the config, for a path but not for `last`) is left out: the config's
        knobs are the run's, and a resume whose knobs differ from the checkpoint's is refused in before_fit
        (`_check_checkpoint`), the same for `last` and a path."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if path and path not in ("last", "best", "hpc") and "://" not in path and not path.startswith("registry"):
            try:
                if not Path(path).is_file():
                    check_checkpoint(path, "--ckpt_path")   # a missing file, or a folder without meta.pt
                resolve_resume(path, [])                   # a torn one, with the readable ones beside it
            except (ValueError, FileNotFoundError) as e:
                _fail(str(e))

    def before_fit(self) -> None:
        """Hold the ModelCheckpoint folders for this run (a second run into one refuses to start). One run
        per output_dir (`_one_run_per_folder`). `--ckpt_path last`: resume from the newest readable
        checkpoint of the ModelCheckpoint folders (lit_ess.checkpoint.resolve_resume), saying so when a torn
        one is passed over. Then the checks that must come before the run starts: the checkpoint's settings
        against the module's (`_check_checkpoint`), the engine against lora.sync: adapter
        (`_check_adapter_sync`)."""
        args = self.config_init[self.subcommand]
        dirs = [Path(cb.dirpath) for cb in self.trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        for d in dirs if self.trainer.is_global_zero else []:     # one run per folder (lit_ess.checkpoint.lock_folder)
            try:
                notice = lock_folder(d)
            except ValueError as e:
                _fail(str(e), traceback=False)
            if notice:
                print(f"lit-ess: {notice}", file=sys.stderr)
        held = self._one_run_per_folder(args)
        hpc = _hpc_checkpoints(self.trainer)           # saved when Slurm preempted the run (_Requeue)
        if args.get("ckpt_path") == "last" and (dirs or hpc):   # neither: Lightning's own search (the logger's folder)
            try:
                args["ckpt_path"], notice = resolve_resume("last", dirs, hpc)
            except ValueError as e:
                _fail(str(e))
            if args["ckpt_path"] is None and held:     # a run without a checkpoint: its logs would mix with ours
                self._refuse(f"--ckpt_path last: output_dir {self.output_dir} holds a run but no checkpoint to "
                             f"resume from: start over with --overwrite true")
            if notice and self.trainer.is_global_zero:
                print(f"lit-ess: {notice}", file=sys.stderr)
        self._check_checkpoint(args.get("ckpt_path"), resuming=True)
        self._check_adapter_sync()

    def _one_run_per_folder(self, args) -> bool:
        """One run per output_dir (lit_ess.output_dir): whether the folder already holds a run (after
        --overwrite true: no longer). A run there and neither --ckpt_path nor --overwrite: refused in one
        line (a Slurm job requeued without --ckpt_path resumes from its hpc checkpoint, as in Lightning).
        --overwrite true: rank 0 removes the old run's folders inside output_dir, after the lock."""
        if not self.output_dir:
            return False
        run = run_of(self.trainer, self.output_dir)
        held = run.held()
        if args.get("overwrite"):
            if args.get("ckpt_path"):
                self._refuse("--overwrite true starts over, --ckpt_path resumes: give one of them")
            hparams = getattr(self.model, "hparams", {})
            for knob in ("model_path", "ref_model_path"):
                path = hparams.get(knob)
                local = Path(path).resolve() if path and Path(path).exists() else None
                if local is not None and any(local.is_relative_to(p) for p in held):
                    self._refuse(f"--overwrite true would remove {knob} {path}, which lies in the old run of "
                                 f"output_dir {self.output_dir}: copy it elsewhere first, or give another output_dir")
            if unowned := run.unowned():
                shown = ", ".join(sorted(str(p.relative_to(run.output_dir)) for p in unowned))
                self._refuse(f"--overwrite true: output_dir {self.output_dir} holds {shown}, which its {MARKER} file does "
                             f"not name as a lit-ess run's (a run of an earlier lit-ess, or not lit-ess's): remove them "
                             f"yourself, or give another output_dir")
            if held and self.trainer.is_global_zero:
                run.clear()
                shown = ", ".join(sorted(str(p.relative_to(run.output_dir)) for p in held))
                print(f"lit-ess: --overwrite true: removed the previous run in {self.output_dir} ({shown})",
                      file=sys.stderr)
            held = []
        if held and args.get("ckpt_path") is None and not (SLURMEnvironment.detect() and run.files):
            self._refuse(refusal(self.output_dir))
        if self.trainer.is_global_zero:
            run.mark()
        return bool(held)

    def _refuse(self, message: str) -> None:
        """One line from rank 0 (every rank stops: they all read the same folder), exit status 2."""
        if self.trainer.is_global_zero:
            _fail(message, traceback=False)
        sys.exit(2)

    def after_fit(self) -> None:
        """Where the run's checkpoint, exported model and logs went (lit_ess.guide.wrap_up), on rank 0; not
        after Ctrl-C or SIGTERM, which _StopNotice reports."""
        trainer = self.trainer
        if not trainer.is_global_zero or trainer.interrupted:
            return
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        exports = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, lit_ess.callbacks.ExportHF)]
        print(wrap_up(trainer, candidates(dirs, _hpc_checkpoints(trainer)), exports, self.output_dir),
              file=sys.stderr, flush=True)

    def before_validate(self) -> None:
        """`--ckpt_path last`: the newest readable checkpoint of the run's ModelCheckpoint folders (output_dir's
        checkpoints/), as fit resumes; none there is one line, not a validation of the untrained model."""
        args = self.config_init[self.subcommand]
        dirs = [Path(cb.dirpath) for cb in self.trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        hpc = _hpc_checkpoints(self.trainer)
        if args.get("ckpt_path") == "last" and (dirs or hpc):
            try:
                args["ckpt_path"], notice = resolve_resume("last", dirs, hpc)
            except ValueError as e:
                _fail(str(e))
            if args["ckpt_path"] is None:
                where = f"output_dir {self.output_dir}" if self.output_dir else ", ".join(map(str, dirs))
                self._refuse(f"--ckpt_path last: no checkpoint in {where} to validate: run fit there first, or "
                             f"give --ckpt_path FILE")
            if notice and self.trainer.is_global_zero:
                print(f"lit-ess: {notice}", file=sys.stderr)
        self._check_checkpoint(args.get("ckpt_path"), resuming=False)
        self._check_adapter_sync()

    def _check_adapter_sync(self) -> None:
        """model.lora.sync: adapter needs an engine that serves adapters of that rank: said before the
        engine starts, not at the first push."""
        lora = self.model.lora if isinstance(self.model, lit_ess.module.PolicyModule) else None
        if lora is None or lora.sync != "adapter" or not isinstance(self.datamodule, RolloutDataModule):
            return
        dm = self.datamodule
        error = dm.engine_config.adapter_error(lora.rank)
        if error is None and Placement.of(dm.schedule.mode, dm.schedule.placement, self.trainer.world_size).shares_servers(dm.engine_config):
            error = SHARED_ADAPTERS
        if error is not None:
            raise ValueError(error)

    def _check_checkpoint(self, ckpt_path, resuming: bool) -> None:
        """Before the engine starts and Lightning loads the weights (a folder of shards: before DCP loads
        them, where a mismatch is a long CheckpointException): the checkpoint's lit_ess block against the
        module (PolicyModule.check_checkpoint_settings: LoRA, base model); when resuming a fit, the model's
        hyper-parameters against the checkpoint's: one line naming each knob that differs, except those
        the module lets a resume change (`RESUME_FREE`). A ValueError: main() prints its one line."""
        saved = saved_settings(ckpt_path)
        if saved is None:
            return
        if isinstance(self.model, lit_ess.module.PolicyModule):
            self.model.check_checkpoint_settings(saved.get("lit_ess", {}))
        free = getattr(self.model, "RESUME_FREE", frozenset())
        changed = resume_changes(saved.get("hyper_parameters") or {}, dict(self.model.hparams), free) if resuming else []
        if changed:
            raise ValueError(f"--ckpt_path {ckpt_path} was trained with other settings than the config's: "
                             f"{', '.join(changed)}: resume with the checkpoint's values, or start a new run from its "
                             f"weights (lit-ess-export {ckpt_path} DIR, then model_path: DIR)")


def _stop_on_sigterm() -> None:
    """SIGTERM is Ctrl-C: Lightning's graceful interrupt (teardown, worker processes stopped at once).
    A rank started by a launcher (LOCAL_RANK > 0, or torchrun) is sent SIGTERM by the kernel when its
    launcher dies, and then says so and exits (its own workers follow it)."""
    launcher = os.getppid() if os.environ.get("LOCAL_RANK", "0") != "0" or "TORCHELASTIC_RUN_ID" in os.environ else None
    stopping = []

    def on_sigterm(signum, frame):
        if launcher is not None and not alive(launcher):
            who = (f"the torchrun launcher of node {node_rank()} (pid {launcher})" if "TORCHELASTIC_RUN_ID" in os.environ
                   else f"rank 0 (the launcher, pid {launcher})")
            print(f"lit-ess: error: {who} died: rank {os.environ.get('RANK', '?')} stops", file=sys.stderr, flush=True)
            os._exit(1)
        if not stopping:               # once: a second SIGTERM during the shutdown changes nothing
            stopping.append(signum)
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():      # main() called from a thread (tests)
        return
    if launcher is not None:
        die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_sigterm)
    _SIGTERM[0] = on_sigterm


_SIGTERM: list = [None]         # the SIGTERM handler of this process (_stop_on_sigterm)


def _dead_peer(error: BaseException) -> str | None:
    """'[node N] rank R (pid P) died: <the backend's error>' when a collective failed because a rank is gone:
    on this host its process (waiting up to 2 s for it to be reaped), on another node its heartbeat
    (lit_ess.lifetime.Peers.dead); else None."""
    import time

    if not Peers.ranks:
        return None
    deadline = time.monotonic() + 2.0
    while not (dead := Peers.dead()) and time.monotonic() < deadline:
        time.sleep(0.1)
    said = _first_line(str(error))
    return f"{dead[0]} died: this rank stops ({type(error).__name__}: {said[:200]})" if dead else None


def _config_folders(argv: list[str]) -> list[str]:
    """The folders of the config files named on the command line (--config F, --config=F, -c F)."""
    paths = [b for a, b in zip(argv, argv[1:]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return [os.path.dirname(os.path.abspath(p)) for p in paths]


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _stop_on_sigterm()
    argv = sys.argv[1:] if args is None else args
    unreadable = check_inputs(argv) or not_offered(argv)
    add_search_folders([*_config_folders(argv), os.getcwd()])     # `my_reward.score` beside the config imports
    if unreadable:              # found in the user's own text: there is no traceback to show
        _fail(unreadable, traceback=False)
    _Parser.args = argv
    try:
        LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                  parser_kwargs=parser_kwargs(), save_config_kwargs={"overwrite": True}, args=args,
                  auto_configure_optimizers=False)
    except (ValueError, FileNotFoundError, OSError) as e:   # bad config or input: one clear line, exit 2
        if os.environ.get("LIT_ESS_TRACEBACK"):
            raise
        _fail(_explain(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
    except (WorkerError, RankFailed, ESSAlarmError, NonFiniteError, EngineFault) as e:   # a fault found mid-run: what and where, exit 1
        if os.environ.get("LIT_ESS_TRACEBACK"):
            raise
        _fail(str(e), code=1)
    except RuntimeError as e:                                 # a collective that failed: a rank died?
        if os.environ.get("LIT_ESS_TRACEBACK") or (message := _dead_peer(e)) is None:
            raise
        _fail(message, code=1)


def run() -> None:
    """The `lit-ess` command: `main`, then the interpreter's exit less its teardown (`_exit`);
    LIT_ESS_FULL_EXIT=1 keeps the interpreter's whole exit (profilers, cleanup left to `__del__`)."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise                         # a message to print: the interpreter's own exit
        code = e.code or 0
    if not os.environ.get("LIT_ESS_FULL_EXIT"):
        _exit(code)
    sys.exit(code)


def _exit(code: int) -> None:
    """End the process as the interpreter would (wait for its threads, run every atexit handler), let the
    trainer ranks it launched on this host end first (their launcher's exit would stop them: PDEATHSIG),
    close or flush every file still open (a file only garbage collection would close holds buffered
    writes; a gzip/bz2/lzma file writes its trailer on close), then skip the teardown of the imported
    libraries. Cleanup left to `__del__` (an unclosed zip archive, a temporary file) does not run."""
    try:
        threading._shutdown()             # the interpreter's first exit step: non-daemon threads, executors
    except KeyboardInterrupt:             # (Ctrl-C while waiting: the interpreter ignores it and goes on)
        pass
    atexit._run_exitfuncs()               # its second, in the same (reverse) order; the registry is cleared
    _wait_for_launched_ranks(timeout=120.0)
    plain = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    files = [obj for obj in gc.get_objects()    # ~0.3 s for 800k objects; isinstance took 4.7 s (it asks
             if type(obj) in plain              # proxies for __class__)
             or (type(obj).__module__ in ("gzip", "bz2", "lzma") and issubclass(type(obj), io.IOBase))]
    for closing in (False, True):               # text wrappers flush into a compressor before it closes
        for f in files:
            if (type(f) not in plain) == closing:
                try:
                    if not f.closed and f.writable():
                        f.close() if closing else f.flush()
                except (OSError, ValueError, RuntimeError):
                    pass
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def _wait_for_launched_ranks(timeout: float) -> None:
    """Rank 0 of a launcher: wait (up to `timeout` s) for the other ranks on this host it started."""
    import time

    children = [pid for r, (pid, host) in enumerate(Peers.ranks)
                if r > 0 and host == socket.gethostname() and _is_child(pid)]
    deadline = time.monotonic() + timeout
    while children and time.monotonic() < deadline:
        children = [pid for pid in children if alive(pid)]
        time.sleep(0.05)


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, IndexError, ValueError):
        return False


if __name__ == "__main__":
    run()
