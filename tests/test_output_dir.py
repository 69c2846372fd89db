"""One output folder per run (lit_ess/output_dir.py), as a user meets it: configs/demo.yaml (the tiny model,
the transformers engine, 2 steps) run with `lit-ess fit` twice into its folder, runs/demo/rl.

Before output_dir, the second run of a config went on silently: it wrote last-v1.ckpt beside the first
run's last.ckpt and its curves into the first run's TensorBoard run, and `validate --ckpt_path last` then
loaded the newest file, the accidental run's."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from e2e_utils import cli, cli_each, write_config
from lit_ess.report import read_scalars

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REFUSAL = ("lit-ess: error: output_dir runs/demo/rl already holds a run: resume it with --ckpt_path last, or start "
           "over with --overwrite true (removes its checkpoints, logs and model)")


def _demo(tiny_model_dir: str, folder: Path) -> Path:
    """configs/demo.yaml as a user would shrink it: the tiny model, the transformers engine, 8 prompts x 4
    samples, 2 steps, a checkpoint every step, 8 held-out prompts (for validate), written to folder/demo.yaml."""
    cfg = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    d = cfg["data"]["init_args"]
    d.update(engine={"class_path": "lit_ess.engines.HFConfig"})
    d["batch"].update(prompts_per_rollout=8, samples_per_prompt=4)
    d["validation"].update(prompts=8, samples=2)
    cfg["trainer"].update(max_steps=2, enable_progress_bar=False)
    for c in cfg["trainer"]["callbacks"]:
        if c["class_path"].endswith("ModelCheckpoint"):
            c["init_args"]["every_n_train_steps"] = 1
    return write_config(cfg, folder / "demo.yaml")


def _event_steps(logs: Path) -> list[set[int]]:
    """The steps of train/loss in each TensorBoard event file under `logs`, oldest file first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(logs.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        out.append({e.step for e in acc.Scalars("train/loss")} if "train/loss" in acc.Tags()["scalars"] else set())
    return out


def _one_line(res) -> str:
    """The one line lit-ess says (Lightning's start-up lines, "Seed set to 0" and the devices, come before it)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("lit-ess")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


@pytest.mark.e2e
def test_a_second_fit_into_a_run_refuses_resumes_or_starts_over(tiny_model_dir, tmp_path):
    """fit twice: the second refuses in one line naming the folder and the two ways on, and writes nothing;
    --ckpt_path last continues from the step the run stopped at, in the same TensorBoard run; --overwrite
    true starts clean (one TensorBoard run, no last-v1.ckpt); validate --ckpt_path last loads that folder's
    last.ckpt. The config file lies in the run's folder: a folder holding only it holds no run, and starting
    over keeps it."""
    config = _demo(tiny_model_dir, tmp_path / "runs/demo/rl")

    def lit_ess(*args):
        return cli([*args[:1], "--config", str(config), *args[1:]], cwd=tmp_path)

    run = tmp_path / "runs/demo/rl"
    ckpts, logs = run / "checkpoints", run / "logs"
    first = lit_ess("fit")
    assert first.returncode == 0, first.stderr[-4000:]
    again = lit_ess("fit")
    assert again.returncode == 2 and _one_line(again) == REFUSAL, again.stderr[-3000:]

    # the wrap-up block of the first run names the folder and what it holds; the second wrote nothing
    assert "  run         runs/demo/rl  (fit it again: --ckpt_path last resumes, --overwrite true starts over)" \
        in first.stderr, first.stderr[-2000:]
    assert "  checkpoint  runs/demo/rl/checkpoints/last.ckpt  (resume: --ckpt_path last)" in first.stderr
    assert "  model       runs/demo/rl/model  (Hugging Face folder" in first.stderr
    assert "  logs        runs/demo/rl/logs  (tensorboard --logdir runs/demo/rl/logs)" in first.stderr
    assert (run / "model" / "config.json").is_file() and (logs / "config.yaml").is_file()
    before = sorted(p.name for p in ckpts.iterdir())
    assert before == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt", "last.ckpt"], before
    assert len(_event_steps(logs)) == 1

    resumed = lit_ess("fit", "--ckpt_path", "last", "--trainer.max_steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "lit-ess: fit done at step 4:" in resumed.stderr, resumed.stderr[-2000:]
    assert _event_steps(logs) == [{1, 2}, {3, 4}]            # the same TensorBoard run, from the step it stopped at
    assert not list(ckpts.glob("last-v*.ckpt"))

    fresh = lit_ess("fit", "--overwrite", "true")
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    assert "lit-ess: --overwrite true: removed the previous run in runs/demo/rl (checkpoints, logs, model)" \
        in fresh.stderr, fresh.stderr[-2000:]
    assert _event_steps(logs) == [{1, 2}]                    # one TensorBoard run: the new one
    assert sorted(p.name for p in ckpts.iterdir()) == before
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 2
    assert config.is_file()                                  # what the old run did not write stays

    val = lit_ess("validate", "--ckpt_path", "last")
    assert val.returncode == 0, val.stderr[-4000:]
    assert f"Loaded model weights from the checkpoint at {ckpts / 'last.ckpt'}" in val.stderr, val.stderr[-2000:]
    assert "val/pass@1" in read_scalars(logs)
    assert sorted(p.name for p in logs.iterdir() if p.suffix == ".yaml") == ["config.yaml", "hparams.yaml"]
    assert yaml.safe_load((logs / "config.yaml").read_text())["overwrite"] is False     # fit's, as given


@pytest.fixture(scope="module")
def refused(tiny_model_dir, tmp_path_factory):
    """Commands refused before the run starts, each in a folder of its own, read in one process
    (e2e_utils.cli_each): {case: CompletedProcess}."""
    root = tmp_path_factory.mktemp("refused")
    folders = {case: root / case for case in ("validate", "both", "no checkpoint", "model inside", "not a run")}
    configs = {case: _demo(tiny_model_dir, folder) for case, folder in folders.items()}
    (folders["no checkpoint"] / "runs/demo/rl/logs").mkdir(parents=True)      # a run stopped before its first checkpoint
    (folders["no checkpoint"] / "runs/demo/rl/logs/events.out.tfevents.1.host").write_bytes(b"")
    inside = folders["model inside"] / "runs/demo/rl/model"                   # model_path: the old run's export
    shutil.copytree(tiny_model_dir, inside)
    cfg = yaml.safe_load(configs["model inside"].read_text())
    cfg["model"]["init_args"]["model_path"] = "runs/demo/rl/model"
    write_config(cfg, configs["model inside"])
    (folders["not a run"] / "runs/demo/rl/logs").mkdir(parents=True)           # the user's own, no lit-ess fit's marker
    (folders["not a run"] / "runs/demo/rl/logs/notes.txt").write_text("mine")
    cases = {"validate": ["validate", "--ckpt_path", "last"], "both": ["fit", "--overwrite", "true", "--ckpt_path", "last"],
             "no checkpoint": ["fit", "--ckpt_path", "last"], "model inside": ["fit", "--overwrite", "true"],
             "not a run": ["fit", "--overwrite", "true"]}
    return cli_each({case: ([args[0], "--config", str(configs[case]), *args[1:]], folders[case])
                     for case, args in cases.items()})


@pytest.mark.parametrize("case, line", [
    ("validate", "lit-ess: error: --ckpt_path last: no checkpoint in output_dir runs/demo/rl to validate: run fit there "
                 "first, or give --ckpt_path FILE"),
    ("both", "lit-ess: error: --overwrite true starts over, --ckpt_path resumes: give one of them"),
    ("no checkpoint", "lit-ess: error: --ckpt_path last: output_dir runs/demo/rl holds a run but no checkpoint to resume "
                      "from: start over with --overwrite true"),
    ("model inside", "lit-ess: error: --overwrite true would remove model_path runs/demo/rl/model, which lies in the old "
                     "run of output_dir runs/demo/rl: copy it elsewhere first, or give another output_dir"),
    ("not a run", "lit-ess: error: --overwrite true: output_dir runs/demo/rl holds logs, which its .lit-ess-run file "
                  "does not name as a lit-ess run's (a run of an earlier lit-ess, or not lit-ess's): remove them yourself, "
                  "or give another output_dir"),
])
def test_what_cannot_be_resumed_or_started_over_is_one_line(refused, case, line):
    """validate --ckpt_path last with no checkpoint (not a validation of the untrained model_path); resume and
    start over at once; a resume into a run that stopped before its first checkpoint (its logs would mix);
    a start over that would remove the model the run starts from; a start over in a folder no lit-ess fit marked
    as its own (the user's ./model is not emptied)."""
    res = refused[case]
    assert res.returncode == 2 and _one_line(res) == line, res.stderr[-3000:]


def _build(cfg: dict, tmp_path: Path):
    """The trainer `lit-ess fit --config` builds from `cfg`, without running."""
    from unittest import mock

    from lit_ess.cli import LitESSCLI, _Parser

    path = write_config(cfg, tmp_path / "c.yaml")
    with mock.patch.object(sys, "argv", ["lit-ess"]):
        return LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                         args=["--config", str(path)], auto_configure_optimizers=False, run=False).trainer


def test_a_path_the_config_sets_is_kept(tiny_model_dir, tmp_path):
    """A checkpoint folder, a logger's save_dir and an export folder the config names stay as given; the rest
    follows output_dir. Without output_dir nothing follows (Lightning's own defaults), and an ExportHF
    without a dirpath is one line."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ess.callbacks import ExportHF

    def build(cfg):
        return _build(cfg, tmp_path)

    cfg = yaml.safe_load(_demo(tiny_model_dir, tmp_path).read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    t = cfg["trainer"]
    t["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(tmp_path / "tb"), "name": "mine", "version": "v"}}
    ckpt = next(c for c in t["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))
    ckpt["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    trainer = build(cfg)
    assert Path(trainer.logger.log_dir) == tmp_path / "tb" / "mine" / "v"
    assert [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint)] == [str(tmp_path / "ckpt")]
    assert [c.dirpath for c in trainer.callbacks if isinstance(c, ExportHF)] == [str(tmp_path / "run" / "model")]
    assert Path(trainer.default_root_dir) == tmp_path / "run"

    cfg["output_dir"] = None
    with pytest.raises(ValueError, match="ExportHF.dirpath is not set: give it a folder, or set output_dir"):
        build(cfg)


def test_trackers_keep_their_local_files_in_the_run_folder(tiny_model_dir, tmp_path, monkeypatch):
    """W&B and MLflow beside each other, their local folders left at Lightning's defaults: W&B's files and
    MLflow's file store go to OUTPUT_DIR/logs; a folder given to one of them stays."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")        # MLflow 3.x opens a file store only with it
    cfg = yaml.safe_load(_demo(tiny_model_dir, tmp_path).read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["trainer"]["logger"] = [
        {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "lit-ess-test", "offline": True}},
        {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {"experiment_name": "lit-ess-test"}}]
    wandb, mlflow = _build(cfg, tmp_path).loggers
    assert Path(wandb.save_dir) == tmp_path / "run" / "logs" and Path(mlflow.save_dir) == tmp_path / "run" / "logs" / "mlruns"
    cfg["trainer"]["logger"][0]["init_args"]["save_dir"] = str(tmp_path / "elsewhere")
    wandb, _ = _build(cfg, tmp_path).loggers
    assert Path(wandb.save_dir) == tmp_path / "elsewhere"


def test_a_folder_holding_only_the_config_of_a_fit_that_stopped_at_start_is_no_run(tmp_path):
    """A fit that stopped at start (a bad config, an engine that did not start) left logs/config.yaml: the next
    fit into that folder is not refused (it was: 'holds a run', and even --ckpt_path last pointed at --overwrite)."""
    from lit_ess.output_dir import Run

    logs, ckpts = tmp_path / "logs", tmp_path / "checkpoints"
    logs.mkdir(), ckpts.mkdir()
    (logs / "config.yaml").write_text("seed_everything: 0\n")
    run = Run(tmp_path, [ckpts, logs])
    assert run.held() == []
    (logs / "events.out.tfevents.1.host").write_bytes(b"")
    assert run.held() == [logs]


def test_overwrite_may_remove_only_the_folders_a_lit_ess_fit_named(tmp_path):
    """Every fit names its folders in output_dir's .lit-ess-run; --overwrite removes only those. A folder the user
    made there later (a model/ a second config's ExportHF would write to) is not the run's, nor are folders of a
    folder no fit marked."""
    from lit_ess.output_dir import Run

    ckpts, logs, model = tmp_path / "checkpoints", tmp_path / "logs", tmp_path / "model"
    for d in (ckpts, logs, model):
        d.mkdir()
        (d / "x").write_text("x")
    assert Run(tmp_path, [ckpts, logs, model]).unowned() == [ckpts, logs, model]      # no marker: nothing is ours
    Run(tmp_path, [ckpts, logs]).mark()                                               # the first fit: no export
    assert Run(tmp_path, [ckpts, logs, model]).unowned() == [model]                   # the user's model/ stays theirs
    Run(tmp_path, [ckpts, logs, model]).mark()                                        # a fit that exports there
    assert Run(tmp_path, [ckpts, logs]).unowned() == [] and Run(tmp_path, [model]).unowned() == []
