"""Every mismatch knob reaches the logged hyper-parameters of a run (TensorBoard's hparams tab, read
here from Lightning's hparams.yaml), and the checkpoint holds them as plain values only."""
import lightning as L
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger

from lit_ess.callbacks import WeightSync
from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.module import PolicyModule
from lit_ess.datamodules.settings import BatchShape, Schedule

PLAIN = (str, int, float, bool, type(None))


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_plain(v) for v in x)
    return isinstance(x, PLAIN)


def test_mismatch_knobs_are_logged_hparams_and_checkpoints_hold_plain_values(tiny_model_dir, tmp_path):
    dm = RolloutDataModule(model_path=tiny_model_dir, source=Arithmetic(size=40), engine=HFConfig(dtype="bfloat16"),
                           sampling=SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3, seed=0),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2, steps_per_rollout=2), schedule=Schedule(max_staleness=3),
                           reward="e2e_utils:digit_fraction")
    model = PolicyModule(tiny_model_dir, train_temperature=1.0)
    logger = TensorBoardLogger(tmp_path, name="tb", version="run")
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=logger, callbacks=[WeightSync()],
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    logged = yaml.unsafe_load((tmp_path / "tb" / "run" / "hparams.yaml").read_text())
    assert logged["engine"]["dtype"] == "bfloat16" and logged["engine"]["behavior_logprobs"] == "processed"
    assert logged["engine"]["name"] == "HFConfig"
    s = logged["sampling"]
    assert (s["temperature"], s["top_p"], s["top_k"]) == (0.7, 0.9, 20)
    assert logged["train_temperature"] == 1.0
    assert (logged["schedule"]["mode"], logged["schedule"]["max_staleness"], logged["batch"]["steps_per_rollout"]) == \
        ("sync", 3, 2)
    assert list((tmp_path / "tb" / "run").glob("events.out.tfevents.*"))      # TensorBoard got them too
    ckpt = torch.load(next((tmp_path / "tb" / "run" / "checkpoints").glob("*.ckpt")), weights_only=False)
    dm_hp = ckpt["datamodule_hyper_parameters"]
    assert _plain(dm_hp) and dm_hp["source"] == "Arithmetic" and dm_hp["engine"]["dtype"] == "bfloat16"
