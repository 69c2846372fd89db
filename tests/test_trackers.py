"""Trackers other than TensorBoard (lit_ess.trackers), as a user meets them: `lit-ess fit` of 2 steps on the tiny
model (hf engine) with `trainer.logger` set to W&B in offline mode or to MLflow with a local file store, then
the run read back from the tracker's own files: every scalar, the histograms (or their quantile scalars) and
the completions table, and the one-line notice of what the tracker cannot show."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from e2e_utils import cli, rl_config, write_config


def _fit(tiny_model_dir, tmp_path: Path, logger: dict, env: dict | None = None):
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=4, samples=2)
    cfg["trainer"]["logger"] = logger
    cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.LogCompletions",
                                        "init_args": {"every_n_steps": 1, "max_rows": 3}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))], cwd=tmp_path,
              env=dict(os.environ, **(env or {})))
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _notices(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("lit-ess: ") and " has no " in ln]


def wandb_records(path: Path) -> list[dict]:
    """The history rows ({key: value}, a histogram or table as a dict of its fields) of an offline W&B run file (`run-*.wandb`): W&B's header (7 bytes) then records in
    LevelDB's log format (32 KiB blocks; each fragment: crc32, length u16, type u8), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, pos, parts = path.read_bytes(), [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                       # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                                # FULL or LAST: one record complete
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                row: dict = {}
                for item in record.history.item:          # a media value comes as items keyed [name, field]
                    key, *field = list(item.nested_key) or [item.key]
                    value = json.loads(item.value_json)
                    if field:
                        row.setdefault(key, {})[field[0]] = value
                    else:
                        row[key] = value
                rows.append(row)
    return rows


def test_wandb_offline_gets_scalars_histograms_and_the_completions_table(tiny_model_dir, tmp_path):
    pytest.importorskip("wandb", reason="the trackers extra is not installed (pip install 'lit-ess[trackers]')")
    res = _fit(tiny_model_dir, tmp_path, {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                          "init_args": {"project": "lit-ess-test", "save_dir": str(tmp_path),
                                                        "offline": True}},
               env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_records(run_file)
    ess = [r["train/ess"] for r in rows if "train/ess" in r]
    assert len(ess) == 2 and all(0 < e <= 1 for e in ess), ess
    hists = [r["ratio/log_ratio"] for r in rows if "ratio/log_ratio" in r]
    assert len(hists) == 2 and all(h["_type"] == "histogram" and sum(h["values"]) > 0 for h in hists), hists
    tables = [r["completions"] for r in rows if "completions" in r]
    assert len(tables) == 2 and tables[0]["_type"] == "table-file", tables
    table = json.loads((run_file.parent / "files" / tables[0]["path"]).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "advantage", "log pi_b", "version"]
    assert len(table["data"]) == 3 and all("+" in row[0] for row in table["data"])   # arithmetic prompts
    assert _notices(res.stderr) == ["lit-ess: WandbLogger has no custom-scalars layout: its charts are grouped "
                                    "by the prefix before '/' only"]


def test_mlflow_file_store_gets_scalars_quantiles_and_the_completions_artifact(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'lit-ess[trackers]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")               # MLflow 3.x refuses a file store without it
    uri = f"file:{tmp_path / 'mlruns'}"
    res = _fit(tiny_model_dir, tmp_path, {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                                          "init_args": {"experiment_name": "lit-ess-test", "tracking_uri": uri}})
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lit-ess-test").experiment_id])
    ess = client.get_metric_history(run.info.run_id, "train/ess")
    assert len(ess) == 2 and all(0 < m.value <= 1 for m in ess)
    assert {"train/loss", "rollout/reward_mean", "ratio/log_ratio/p05", "ratio/log_ratio/p50", "ratio/log_ratio/p95",
            "ratio/capped_weight/p50", "rollout/policy_lag/p50"} <= set(run.data.metrics)
    p05, p95 = (client.get_metric_history(run.info.run_id, f"ratio/log_ratio/{q}") for q in ("p05", "p95"))
    assert len(p05) == 2 and all(a.value <= b.value for a, b in zip(p05, p95))
    files = sorted(f.path for f in client.list_artifacts(run.info.run_id, "completions"))
    assert files == ["completions/step_000000.json", "completions/step_000001.json"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, files[0], str(tmp_path))).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "advantage", "log pi_b", "version"]
    assert len(table["data"]) == 3 and all("+" in row[0] for row in table["data"])
    assert _notices(res.stderr) == ["lit-ess: MLFlowLogger has no histograms or custom-scalars layout: histograms "
                                    "are logged as their p05/p50/p95 scalars (e.g. ratio/log_ratio/p50); its charts "
                                    "are grouped by the prefix before '/' only"]


def test_each_logger_says_in_one_line_what_it_cannot_show(tmp_path, monkeypatch):
    """The notices for a trainer with all four kinds of logger: TensorBoard shows everything and says nothing;
    a logger is told only of what the trainer's callbacks write."""
    pytest.importorskip("wandb", reason="the trackers extra is not installed (pip install 'lit-ess[trackers]')")
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (pip install 'lit-ess[trackers]')")
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    from lit_ess.callbacks import LogCompletions, RatioDashboard
    from lit_ess.trackers import notices

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    loggers = [TensorBoardLogger(tmp_path), WandbLogger(save_dir=tmp_path, offline=True),
               MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}"), CSVLogger(tmp_path)]
    both = L.Trainer(logger=loggers, callbacks=[RatioDashboard(), LogCompletions()], enable_progress_bar=False)
    assert notices(both) == [
        "lit-ess: WandbLogger has no custom-scalars layout: its charts are grouped by the prefix before '/' only",
        "lit-ess: MLFlowLogger has no histograms or custom-scalars layout: histograms are logged as their "
        "p05/p50/p95 scalars (e.g. ratio/log_ratio/p50); its charts are grouped by the prefix before '/' only",
        "lit-ess: CSVLogger has no histograms, custom-scalars layout or tables: histograms are logged as their "
        "p05/p50/p95 scalars (e.g. ratio/log_ratio/p50); its charts are grouped by the prefix before '/' only; "
        "completion tables are not logged to it"]
    tables = L.Trainer(logger=loggers, callbacks=[LogCompletions()], enable_progress_bar=False)
    assert notices(tables) == ["lit-ess: CSVLogger has no tables: completion tables are not logged to it"]
