"""Faults of the newer surfaces (issue 38): resume with other knobs or another model, config files that do
not parse, servers by URL that do not answer as vLLM does, timeouts named by their knob."""
import re

import pytest
import torch

from e2e_utils import cli, cli_each, rl_config, write_config
from test_faults_state import fault_line


# ---------------------------------------------------------------- resume

@pytest.fixture(scope="module")
def p3o_run(tiny_model_dir, tmp_path_factory):
    """A 2-step P3O run (hf engine) with a checkpoint at each step and last.ckpt."""
    tmp = tmp_path_factory.mktemp("p3o")
    cfg = rl_config(tiny_model_dir, tmp, engine="HFConfig", max_steps=2, ckpt_every=1)
    res = cli(["fit", "--config", str(write_config(cfg, tmp / "c.yaml"))], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return cfg, tmp


@pytest.mark.e2e
def test_a_resume_with_other_knobs_is_refused_for_a_path_and_last(p3o_run):
    """The config changed to GRPO and another lr: `--ckpt_path FILE` and `--ckpt_path last` both refuse in one
    line naming each knob with both values (main: the path trained P3O at the checkpoint's lr, exit 0; `last`
    trained GRPO). A knob a resume may change (micro_batch_size) resumes, with the config's value."""
    cfg, tmp = p3o_run
    first = next((tmp / "ckpt").glob("*step=1.ckpt"))
    cfg = {**cfg, "trainer": {**cfg["trainer"], "max_steps": 3}}
    changed = {**cfg, "model": {**cfg["model"], "init_args": {**cfg["model"]["init_args"], "lr": 5e-4,
               "objective": {"class_path": "lit_ess.objectives.GRPO"}}}}
    path = str(write_config(changed, tmp / "grpo.yaml"))
    runs = cli_each({form: (["fit", "--config", path, "--ckpt_path", ckpt], tmp)
                     for form, ckpt in (("path", str(first)), ("last", "last"))}, timeout=600)
    for form, res in runs.items():
        line = fault_line(res, code=2)
        assert "model.objective P3O -> GRPO" in line and "model.lr 0.001 -> 0.0005" in line, (form, line)
        assert str(first if form == "path" else tmp / "ckpt" / "last.ckpt") in line, (form, line)
    assert not list((tmp / "ckpt").glob("*step=3.ckpt"))
    memory = {**cfg, "model": {**cfg["model"], "init_args": {**cfg["model"]["init_args"], "micro_batch_size": 8}}}
    res = cli(["fit", "--config", str(write_config(memory, tmp / "mbs.yaml")), "--ckpt_path", str(first)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = torch.load(next((tmp / "ckpt").glob("*step=3.ckpt")), weights_only=False)["hyper_parameters"]
    assert saved["micro_batch_size"] == 8 and saved["lr"] == 1e-3


@pytest.mark.e2e
def test_a_resume_on_a_model_of_another_width_names_the_shape_and_the_checkpoint(tmp_path):
    """The model folder rebuilt wider after a 1-step run (the same model_path): the resume stops in one line
    naming a tensor, both shapes and the checkpoint (main: a bare `Error(s) in loading state_dict` traceback)."""
    import shutil

    from lit_ess.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", hidden_size=96, num_heads=2, num_kv_heads=2, intermediate_size=128)
    cfg = rl_config(str(model), tmp_path, engine="HFConfig", max_steps=1, ckpt_every=1)
    path = str(write_config(cfg, tmp_path / "c.yaml"))
    assert cli(["fit", "--config", path], timeout=300).returncode == 0
    shutil.rmtree(model)
    build_tiny_model(model, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
    ckpt = next((tmp_path / "ckpt").glob("*step=1.ckpt"))
    cfg["trainer"]["max_steps"] = 2
    line = fault_line(cli(["fit", "--config", str(write_config(cfg, tmp_path / "c2.yaml")), "--ckpt_path", str(ckpt)],
                          timeout=300), code=2)
    assert f"the checkpoint {ckpt} holds a model of another shape than model_path={str(model)!r}" in line, line
    assert re.search(r"resume with the model it was trained from \(policy\.\S+: \[\d+, 96\] in the checkpoint, "
                     r"\[\d+, 128\] in the model; \d+ tensor\(s\) differ\)$", line), line
