"""Dry runs of the GPU configs in configs/ (real models, several GPUs and nodes: they cannot run here).

Each config is read by the real CLI parser and every class it names is built (LitESSCLI with run=False:
PolicyModule, RolloutDataModule with its prompt sources, engine and sampling configs, the Trainer with
its strategy, logger and callbacks), with what needs the hardware or the hub swapped out: the tiny model
for the real one, this CPU (accelerator cpu, 1 device, 1 node, ModelParallelStrategy kept with
data_parallel_size 1) for the GPUs, and a small local jsonl with the same fields for the hub datasets.
Everything else is the config's own, so a typo'd key, a value out of range or a field the prompt source
cannot read fails here. The hardware settings themselves are checked for consistency (W = devices x
nodes everywhere it must appear). vLLM is not started: its GPU settings (fp8, external_launcher,
gpu_memory_utilization) are checked on paper only. The CPU configs (the demos) are built the same way,
as written, with only the tiny model and the run's folder (output_dir) swapped in. Every config names its
run's folder once (output_dir): checkpoints, logs and the export follow it.
"""
import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy

import lit_ess.callbacks
from lit_ess.datamodules import HFPrompts, RolloutDataModule
from lit_ess.cli import LitESSCLI, _explain, _Parser
from lit_ess.engines import VLLMConfig
from lit_ess.module import PolicyModule
from lit_ess.rewards import resolve_reward

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GPU_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml")
                     if yaml.safe_load(p.read_text())["trainer"].get("accelerator", "cpu") != "cpu")
# a row the config's reward scores 1.0 with the completion beside it (the answer in the dataset's own format)
ROWS = {"gsm8k": ("Natalia sold 48 clips in April and half as many in May. How many in all?",
                  "48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "So she sold 72 clips.\n#### 72"),
        "math_verify": ("What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}", "The sum is $\\boxed{\\frac{3}{4}}$.")}


def test_gpu_configs_exist():
    names = {p.name for p in GPU_CONFIGS}
    assert {"qwen2.5-1.5b_gsm8k_1x8gpu.yaml", "qwen2.5-1.5b_gsm8k_2x8gpu.yaml",
            "qwen3-4b_deepscaler_1x8gpu.yaml", "qwen3-4b_deepscaler_2x8gpu.yaml"} <= names


def _callback(cfg: dict, class_path: str) -> dict:
    found = [c for c in cfg["trainer"].get("callbacks", []) if c["class_path"] == class_path]
    assert len(found) == 1, f"expected one {class_path} callback"
    return found[0].get("init_args", {})


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_hardware_settings_agree(path):
    """W = devices x num_nodes is the data-parallel size FSDP2 shards over and a divisor of the prompts;
    the header says what the config is and how to launch it."""
    cfg = yaml.safe_load(path.read_text())
    t, data = cfg["trainer"], cfg["data"]["init_args"]
    world = t["devices"] * t.get("num_nodes", 1)
    assert t["strategy"]["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert t["strategy"]["init_args"] == {"data_parallel_size": world, "tensor_parallel_size": 1}
    assert data["batch"]["prompts_per_rollout"] % world == 0
    engine = data["engine"]["init_args"]
    assert engine["max_model_len"] >= data["max_prompt_tokens"] + data["sampling"]["max_new_tokens"]
    assert 0 < engine["gpu_memory_utilization"] < 0.5                      # colocated with the trainer
    assert _callback(cfg, "lit_ess.callbacks.FSDP2")["param_dtype"] == "bfloat16"
    assert cfg["output_dir"] and "dirpath" not in _callback(cfg, "lightning.pytorch.callbacks.ModelCheckpoint")
    header = path.read_text().split("\nseed_everything")[0]
    assert f"--config configs/{path.name}" in header and "Hardware assumed" in header
    if t.get("num_nodes", 1) > 1:
        assert "--nnodes" in header and "srun" in header


def _dry_config(path: Path, model_dir: str, tmp_path: Path) -> dict:
    """The config with the tiny model, this CPU and local prompt files swapped in; the rest as written."""
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["init_args"]["model_path"] = model_dir
    data = cfg["data"]["init_args"]
    assert data["reward"] in ROWS, f"reward {data['reward']!r}: not a built-in reward with a sample row in ROWS"
    prompt, answer, _ = ROWS[data["reward"]]
    for key, src in (("source", data.get("source")), ("val_source", (data.get("validation") or {}).get("source"))):
        if src and src["class_path"] == "lit_ess.datamodules.HFPrompts":
            args = src["init_args"]
            rows = [{args.get("prompt_field", "prompt"): f"{prompt} ({i})", args.get("answer_field", "answer"): answer,
                     "other": "unused"} for i in range(4)]
            local = tmp_path / f"{key}.jsonl"
            local.write_text("".join(json.dumps(r) + "\n" for r in rows))
            args.update(path=str(local), split="train")       # a local file has one split
            args.pop("name", None)
    t = cfg["trainer"]
    t.update(accelerator="cpu", devices=1, num_nodes=1)
    t["strategy"]["init_args"]["data_parallel_size"] = 1
    cfg["output_dir"] = str(tmp_path / "run")
    return cfg


def _build(cfg: dict, tmp_path: Path) -> LitESSCLI:
    """Parse and instantiate as `lit-ess fit --config` does (lit_ess.cli.main's arguments), without running."""
    f = tmp_path / "dry.yaml"
    f.write_text(yaml.safe_dump(cfg))
    with mock.patch.object(sys, "argv", ["lit-ess"]):     # LightningCLI warns when pytest's own arguments are there
        return LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                         args=["--config", str(f)], auto_configure_optimizers=False, run=False)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_config_builds_with_the_tiny_model(path, tiny_model_dir, tmp_path):
    cfg = _dry_config(path, tiny_model_dir, tmp_path)
    cli = _build(cfg, tmp_path)
    written = yaml.safe_load(path.read_text())
    data = written["data"]["init_args"]

    model, dm, trainer = cli.model, cli.datamodule, cli.trainer
    assert isinstance(model, PolicyModule) and type(model.objective).__name__ == "P3O"
    assert model.micro_batch.size == written["model"]["init_args"]["micro_batch"]["size"]
    model.configure_model()                                 # loads the (tiny) policy with the config's dtype
    assert next(model.policy.parameters()).dtype.__str__() == f"torch.{model.compute.dtype}"

    assert isinstance(dm, RolloutDataModule) and dm.model_path == tiny_model_dir     # linked from the model
    assert (dm.batch.prompts_per_rollout, dm.batch.samples_per_prompt) == (data["batch"]["prompts_per_rollout"],
                                                                       data["batch"]["samples_per_prompt"])
    assert dm.sampling.max_new_tokens == data["sampling"]["max_new_tokens"]
    assert isinstance(dm.engine_config, VLLMConfig)
    assert dm.engine_config.vllm_kwargs == data["engine"]["init_args"]["vllm_kwargs"]
    reward = resolve_reward(dm.reward_name)
    _, answer, completion = ROWS[dm.reward_name]
    for src in (dm.source, dm.validation.source):
        assert isinstance(src, HFPrompts) and len(src.examples) == 4 and src.skipped == 0
        ex = src.examples[0]
        assert ex.answer == answer and ex.prompt.startswith(ROWS[dm.reward_name][0])
        assert reward(completion, ex.answer) == 1.0 and reward("no answer here", ex.answer) == 0.0
    if dm.reward_name == "math_verify":                     # the template's braces survive str.format
        assert dm.source.examples[0].prompt.endswith("\\boxed{}.")

    assert isinstance(trainer.strategy, ModelParallelStrategy)
    assert trainer.max_steps == written["trainer"]["max_steps"]
    _follows_the_output_dir(trainer, tmp_path / "run")
    kinds = {type(c) for c in trainer.callbacks}
    assert {lit_ess.callbacks.FSDP2, lit_ess.callbacks.WeightSync, lit_ess.callbacks.RatioDashboard, lit_ess.callbacks.LogCompletions,
            lit_ess.callbacks.ExportHF, ModelCheckpoint} <= kinds
    fsdp = next(c for c in trainer.callbacks if isinstance(c, lit_ess.callbacks.FSDP2))
    assert (fsdp.param_dtype, fsdp.reduce_dtype, fsdp.activation_checkpointing) == ("bfloat16", "float32", True)


def _follows_the_output_dir(trainer, out: Path) -> None:
    """Checkpoints, TensorBoard and the export of the built trainer lie in the run's folder `out`."""
    assert isinstance(trainer.logger, TensorBoardLogger) and Path(trainer.logger.log_dir) == out / "logs"
    assert Path(trainer.default_root_dir) == out
    for c in trainer.callbacks:
        if isinstance(c, ModelCheckpoint):
            assert c.dirpath == str(out.resolve() / "checkpoints")
        if isinstance(c, lit_ess.callbacks.ExportHF):
            assert Path(c.dirpath) == out / "model"


def test_every_config_names_its_run_folder_once():
    """One output_dir per config, each its own; no checkpoint, log or export path of their own (they follow it);
    a model_path under runs/ (the demos' warm starts) is the model/ folder of a config that exports one, or a
    model `python -m lit_ess.tiny` builds (runs/demo/init; runs/demo/chat_init with a chat template)."""
    cfgs = {p.name: (p.read_text(), yaml.safe_load(p.read_text())) for p in sorted(CONFIGS.glob("*.yaml"))}
    exported = {f"{cfg['output_dir']}/model" for _, cfg in cfgs.values()
                if any(c["class_path"].endswith("ExportHF") for c in cfg["trainer"].get("callbacks", []))}
    for name, (text, cfg) in cfgs.items():
        assert cfg.get("output_dir"), name
        for key in ("dirpath", "save_dir", "default_root_dir", "logger:"):
            assert key not in text.replace("# logger:", ""), f"{name}: {key} (let it follow output_dir)"
        model_path = cfg["model"]["init_args"]["model_path"]
        assert not model_path.startswith("runs/") or model_path in ("runs/demo/init", "runs/demo/chat_init") or model_path in exported, name
    folders = [cfg["output_dir"] for _, cfg in cfgs.values()]
    assert len(set(folders)) == len(folders), folders


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value


@pytest.mark.parametrize("dotted, value, says", [
    ("model.init_args.micro_batch_sise", 8, "micro_batch_sise"),                 # typo'd key
    ("data.init_args.sampling.max_new_token", 1024, "max_new_token"),           # typo'd key in a dataclass
    ("data.init_args.engine.init_args.quantisation", "fp8", "quantisation"),    # typo'd engine key
    ("trainer.callbacks.0.init_args.param_dtype", "bf16", "param_dtype"),       # FSDP2: not a dtype it knows
    ("data.init_args.sampling.temperature", 0.0, "temperature must be > 0"),   # out of range
    ("data.init_args.source.init_args.prompt_field", "questions", "field 'questions' missing"),  # not in the file
    ("trainer.strategy.init_args.data_parallel_sizes", 1, "data_parallel_sizes"),  # typo'd strategy key
    ("trainer.callbacks.4.init_args.save_top_k", 3, "monitor=None"),           # top-k needs a monitor
])
def test_a_broken_config_fails_the_dry_run(dotted, value, says, tiny_model_dir, tmp_path, capsys):
    """The dry run is a real check: one wrong key or value in a config stops it."""
    path = CONFIGS / "qwen3-4b_deepscaler_1x8gpu.yaml"
    cfg = _dry_config(path, tiny_model_dir, tmp_path)
    assert [c["class_path"].split(".")[-1] for c in cfg["trainer"]["callbacks"]][0:5:4] == ["FSDP2", "ModelCheckpoint"]
    _set(cfg, dotted, value)
    with pytest.raises((SystemExit, ValueError)) as err:
        _build(cfg, tmp_path)
    # the line `lit-ess fit` prints: the parser's own (exit 2), or lit_ess.cli.main's for a constructor's ValueError
    line = capsys.readouterr().err if err.type is SystemExit else _explain(err.value)
    assert says in line, line


CPU_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p not in GPU_CONFIGS)
# configs of the standard environments: the package of the `envs` extra each needs (skipped without it)
NEEDS = {"demo_reasoning_gym.yaml": "reasoning_gym", "demo_verifiers.yaml": "verifiers.v1",
         "demo_openenv.yaml": "openenv.core"}


def test_cpu_configs_include_the_demos():
    assert {"demo_sft.yaml", "demo.yaml", "demo_multiturn.yaml", "demo_calculator_sft.yaml",
            "demo_calculator.yaml"} <= {p.name for p in CPU_CONFIGS}


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.stem)
def test_cpu_config_builds_with_the_tiny_model(path, tiny_model_dir, tmp_path, monkeypatch):
    """The demo configs as written (the tiny model and temporary output folders swapped in) parse, and
    every class they name is built: a typo'd key or a value out of range fails here, without a run."""
    if path.name in NEEDS:
        pytest.importorskip(NEEDS[path.name], reason=f"{path.name} needs the `envs` extra: pip install 'lit-ess[envs]'")
    if path.name == "demo_verifiers.yaml":              # its taskset is the module beside it, as the CLI finds it
        monkeypatch.syspath_prepend(str(CONFIGS))
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    cfg["output_dir"] = str(tmp_path / "run")
    cli = _build(cfg, tmp_path)
    assert type(cli.model).__name__ == cfg["model"]["class_path"].split(".")[-1]
    assert type(cli.datamodule).__name__ == cfg["data"]["class_path"].split(".")[-1]
    assert cli.trainer.max_steps == cfg["trainer"]["max_steps"]
    _follows_the_output_dir(cli.trainer, tmp_path / "run")
