"""What a newcomer meets at the command line: a quiet console with a progress bar, every knob in
--print_config, errors that say what to do, sample completions in TensorBoard."""
import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from e2e_utils import cli, cli_each, noisy_lines
from lit_ess.objectives import OBJECTIVE_CLASSES
from lit_ess.report import read_texts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO = str(CONFIGS / "demo.yaml")


def _demo_args(model_dir, *extra) -> list[str]:
    return ["fit", "--config", DEMO, "--model.init_args.model_path", model_dir, *extra]


def _demo_config(folder: Path, model_dir, **edits) -> str:
    """configs/demo.yaml with the tiny model and `edits` (dotted key: value) applied, written to folder/old.yaml."""
    cfg = yaml.safe_load(open(DEMO))
    cfg["model"]["init_args"]["model_path"] = model_dir
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[last] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "old.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


PRINTED = [(), ("--model.init_args.micro_batch.packing", "true", "--model.init_args.micro_batch.tokens", "512"),
           ("--data.init_args.engine", "HFConfig"), ("--data.init_args.advantage", "RLOO"),
           ("--data.init_args.env", '{"env": {"class_path": "RetryArithmetic", "init_args": {"max_tries": 2}}}')] + [("--model.init_args.objective", c.__name__) for c in OBJECTIVE_CLASSES]
ENGINES = "choose one of VLLMConfig, VLLMServerConfig, HFConfig"
UNKNOWN_ARGS = [
    (["--model.init_args.objective", "PPO9000"], "choose one of P3O, P4O, GRPO, DAPO, GSPO, CISPO, DecoupledPPO, REINFORCE"),
    (["--data.init_args.engine", "hf"], f"data.init_args.engine: 'hf' is not a known engine; {ENGINES}"),
]
UNKNOWN_FILES = [
    ("model.init_args.objective", "grpo", "model.init_args.objective: 'grpo' is not a known objective; choose one of P3O"),
    ("data.init_args.engine", "vllm", f"data.init_args.engine: 'vllm' is not a known engine; {ENGINES}"),
]
# one bad value per group of settings (lit_ess/settings.py, datamodules/settings.py): the line names its full key
GROUP_REFUSALS = [
    ("data.init_args.batch.samples_per_prompt", "0"), ("data.init_args.schedule.max_staleness", "-1"),
    ("data.init_args.reward_limits.max_error_rate", "1.5"), ("data.init_args.validation.samples", "0"),
    ("model.init_args.optim.lr", "-1"), ("model.init_args.micro_batch.tokens", "0"),
    ("model.init_args.compute.logprob_chunk", "0"), ("model.init_args.ess_alarm.threshold", "2"),
]
# a class_path of a field that also takes a name (env: str | class, advantage: Literal | class): the class's
# reason under the field's full key, not 'Parser key "env": Expected a <class 'str'>'; an environment's
# required argument missing: its full key
CLASS_REFUSALS = [
    ("env", '{"env": {"class_path": "lit_ess.envs.RetryArithmetc"}}',
     "data.init_args.env.env: Type typing.Callable[[], lit_ess.envs.base.Environment] expects a function or a "
     "callable class: module 'lit_ess.envs' has no attribute 'RetryArithmetc'"),
    ("advantage", '{"class_path": "lit_ess.advantages.RLOOO"}',
     "data.init_args.advantage: Problem with given class_path 'lit_ess.advantages.RLOOO': module "
     "'lit_ess.advantages' has no attribute 'RLOOO'"),
    ("source", '{"class_path": "lit_ess.datamodules.Arithmetc"}',      # validation.source is one too: the one quoted
     "data.init_args.source: Problem with given class_path 'lit_ess.datamodules.Arithmetc': module "
     "'lit_ess.datamodules' has no attribute 'Arithmetc'"),
    ("env", '{"env": {"class_path": "lit_ess.envs.Agent"}}',
     "data.init_args.env.env.init_args.function is required (lit_ess.envs.Agent has no default for it)"),
]


@pytest.fixture(scope="module")
def read_in_one_process(tiny_model_dir, tmp_path_factory):
    """`lit-ess fit` for each config below that ends while it is read (printed with --print_config, or
    refused), all in one process (e2e_utils.cli_each: one start of Lightning instead of 25), by key:
    the CompletedProcess and the config file it read. The first case of each refusal test, and the
    tests of one case, run `lit-ess` in a process of their own, as users meet it."""
    tmp = tmp_path_factory.mktemp("cli_each")
    cases, files = {}, {}
    for extra in PRINTED:
        cases[("print", *extra)] = (_demo_args(tiny_model_dir, *extra, "--print_config"), None)
    cases[("nccl",)] = (_demo_args(tiny_model_dir, "--data.init_args.engine.init_args.transport", "nccl"), None)
    cases[("max_grad_norm",)] = (_demo_args(tiny_model_dir, "--model.init_args.optim.max_grad_norm", "-1"), None)
    for key, value in GROUP_REFUSALS:
        cases[("group", key)] = (_demo_args(tiny_model_dir, f"--{key}", value), None)
    for key, value, _ in CLASS_REFUSALS:
        cases[("class", key, value)] = (_demo_args(tiny_model_dir, f"--data.init_args.{key}", value), None)
    files[("class file",)] = _demo_config(tmp / "class_file", tiny_model_dir,
                                          **{"data.init_args.env": {"env": {"class_path": "lit_ess.envs.Agent"}}})
    cases[("class file",)] = (["fit", "--config", files[("class file",)]], tmp / "class_file")
    for args, _ in UNKNOWN_ARGS[1:]:
        cases[("unknown", *args)] = (_demo_args(tiny_model_dir, *args), None)
    for i, (key, value, _) in enumerate(UNKNOWN_FILES[1:]):
        files[("file", key)] = _demo_config(tmp / f"file{i}", tiny_model_dir, **{key: value})
        cases[("file", key)] = (["fit", "--config", files[("file", key)]], tmp / f"file{i}")
    return {k: (res, files.get(k)) for k, res in cli_each(cases).items()}


def print_config(read, *extra):
    res, _ = read[("print", *extra)]
    assert res.returncode == 0, res.stderr[-3000:]
    return yaml.safe_load(res.stdout)


@pytest.mark.parametrize("cls", OBJECTIVE_CLASSES, ids=lambda c: c.__name__)
def test_print_config_lists_every_objective_hyper_parameter(read_in_one_process, cls):
    cfg = print_config(read_in_one_process, "--model.init_args.objective", cls.__name__)
    objective = cfg["model"]["init_args"]["objective"]
    assert objective["class_path"] == f"lit_ess.objectives.{cls.__name__}"
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    assert objective["init_args"] == defaults             # every field, with its default


def test_print_config_shows_the_groups_with_their_defaults(read_in_one_process):
    """The data module's and the policy's knobs sit in their groups, each with its default or the demo's value."""
    cfg = print_config(read_in_one_process)
    data, model = cfg["data"]["init_args"], cfg["model"]["init_args"]
    assert data["batch"] == {"prompts_per_rollout": 32, "samples_per_prompt": 8, "steps_per_rollout": 1,
                             "steps_per_epoch": None}
    assert data["schedule"] == {"mode": "sync", "placement": "colocated", "max_staleness": None, "worker_timeout": 1800.0}
    assert data["reward_limits"] == {"timeout": 5.0, "max_error_rate": 0.5, "in_worker": None}
    assert (data["validation"]["prompts"], data["validation"]["samples"], data["validation"]["sampling"]) == (128, 4, None)
    assert data["validation"]["source"]["class_path"] == "lit_ess.datamodules.Arithmetic"
    assert model["optim"]["lr"] == 2.0e-4 and model["optim"]["lr_schedule"] == "constant"
    assert model["micro_batch"] == {"size": None, "tokens": None, "packing": False}
    assert model["compute"] == {"dtype": "float32", "gradient_checkpointing": False, "logprob_chunk": 1024,
                                "disable_dropout": True}
    assert model["ess_alarm"] == {"threshold": 0.999, "error": False}
    flat = ("prompts_per_rollout", "max_staleness", "val_source", "reward_timeout", "lr", "micro_batch_size",
            "model_dtype", "ess_alarm_error")
    assert not set(flat) & (set(data) | set(model))


@pytest.mark.parametrize("key, value", GROUP_REFUSALS, ids=[k for k, _ in GROUP_REFUSALS])
def test_a_bad_value_in_a_group_names_its_full_key(read_in_one_process, key, value):
    res, _ = read_in_one_process[("group", key)]
    line = res.stderr.strip().splitlines()[-2]
    assert res.returncode == 2 and line.startswith(f"lit-ess: error: {key.replace('.init_args', '')} must be "), line


def test_an_old_flat_key_names_its_new_place(tiny_model_dir, tmp_path):
    """A key of the flat data module or policy (before the groups), in a config file or on the command line,
    for the data module or the model: one line naming its new place, exit 2, before anything is built."""
    old = _demo_config(tmp_path, tiny_model_dir)
    cfg = yaml.safe_load(open(old))
    cfg["data"]["init_args"]["prompts_per_rollout"] = 8
    (tmp_path / "data.yaml").write_text(yaml.safe_dump(cfg))
    cfg = yaml.safe_load(open(old))
    cfg["model"]["init_args"]["lr"] = 1e-4
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(cfg))
    said = {"file data": (["fit", "--config", str(tmp_path / "data.yaml")],
                          f"{tmp_path / 'data.yaml'}: data.prompts_per_rollout is now data.batch.prompts_per_rollout"),
            "file model": (["fit", "--config", str(tmp_path / "model.yaml")],
                           f"{tmp_path / 'model.yaml'}: model.lr is now model.optim.lr"),
            "line data": (_demo_args(tiny_model_dir, "--data.init_args.max_staleness", "2"),
                          "--data.max_staleness is now --data.schedule.max_staleness"),
            "line model": (_demo_args(tiny_model_dir, "--model.micro_batch_size", "4"),
                           "--model.micro_batch_size is now --model.micro_batch.size"),
            "alarm": (_demo_args(tiny_model_dir, "--model.init_args.ess_alarm", "0.99"),
                      "--model.ess_alarm is now --model.ess_alarm.threshold")}
    runs = cli_each({name: (args, tmp_path) for name, (args, _) in said.items()})
    for name, (_, line) in said.items():
        res = runs[name]
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"lit-ess: error: {line}"], (name, res.stderr)


def test_the_old_key_table_leaves_other_modules_alone(tmp_path):
    """SFTModule keeps its flat lr: the table judges the keys of PolicyModule and RolloutDataModule only."""
    from lit_ess.config_check import check_inputs

    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model:\n  class_path: lit_ess.sft.SFTModule\n  init_args: {lr: 1.0e-3}\n"
                   "data:\n  class_path: lit_ess.datamodules.SFTDataModule\n  init_args: {val_prompts: 4}\n")
    assert check_inputs(["--config", str(cfg), "--model.lr", "2e-3"]) is None
    assert check_inputs(["--model", "PolicyModule", "--model.lr", "2e-3"]) == "--model.lr is now --model.optim.lr"


def test_print_config_lists_the_run_folder(read_in_one_process):
    """output_dir (the demo's run folder, named once) and fit's --overwrite, with their defaults."""
    cfg = print_config(read_in_one_process)
    assert cfg["output_dir"] == "runs/demo/rl" and cfg["overwrite"] is False
    assert cfg["trainer"]["logger"] is None and cfg["trainer"]["default_root_dir"] is None   # they follow it


def test_print_config_lists_the_token_knobs(read_in_one_process):
    """micro_batch.tokens and packing are in the printed config, with their defaults, and take a value."""
    model = print_config(read_in_one_process)["model"]["init_args"]
    assert model["micro_batch"]["tokens"] is None and model["micro_batch"]["packing"] is False
    model = print_config(read_in_one_process, "--model.init_args.micro_batch.packing", "true",
                         "--model.init_args.micro_batch.tokens", "512")["model"]["init_args"]
    assert model["micro_batch"]["packing"] is True and model["micro_batch"]["tokens"] == 512


def test_print_config_lists_engine_settings(read_in_one_process):
    cfg = print_config(read_in_one_process, "--data.init_args.engine", "HFConfig")
    assert cfg["data"]["init_args"]["engine"] == {"class_path": "lit_ess.engines.HFConfig",
                                                  "init_args": {"dtype": "float32", "device": "cpu", "batch_size": 256,
                                                                "behavior_logprobs": "processed"}}
    vllm = print_config(read_in_one_process)["data"]["init_args"]["engine"]["init_args"]
    assert {"dtype", "gpu_memory_utilization", "kv_cache_gib", "max_model_len", "enforce_eager", "seed",
            "behavior_logprobs", "vllm_kwargs", "worker_devices", "transport", "bucket_mb", "max_lora_rank"} == set(vllm)
    assert (vllm["worker_devices"], vllm["transport"]) == (None, "shared_memory")   # colocated by default


def test_print_config_lists_the_environment_and_advantage_by_class(read_in_one_process):
    """data.env.env and data.advantage are chosen by class: the printed config shows every constructor argument."""
    env = print_config(read_in_one_process, "--data.init_args.env",
                       '{"env": {"class_path": "RetryArithmetic", "init_args": {"max_tries": 2}}}')["data"]["init_args"]["env"]
    assert env["env"] == {"class_path": "lit_ess.envs.RetryArithmetic", "init_args": {"max_tries": 2, "feedback": "wrong"}}
    assert print_config(read_in_one_process)["data"]["init_args"]["advantage"] == "zscore"
    assert print_config(read_in_one_process, "--data.init_args.advantage", "RLOO")["data"]["init_args"]["advantage"] == \
        {"class_path": "lit_ess.advantages.RLOO"}


def test_nccl_without_dedicated_devices_is_one_line(read_in_one_process):
    res, _ = read_in_one_process[("nccl",)]
    assert "transport: nccl needs worker_devices" in _one_error_line(res)


def _one_error_line(res):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "Namespace(" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("lit-ess: error:")]
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_bad_value_is_named_first_on_one_line(tiny_model_dir):
    res = cli(_demo_args(tiny_model_dir, "--data.init_args.sampling.temperature", "0"))
    line = _one_error_line(res)
    assert line.startswith("lit-ess: error: sampling.temperature must be > 0"), line


def test_max_grad_norm_minus_one_is_refused_on_one_line(read_in_one_process):
    res, _ = read_in_one_process[("max_grad_norm",)]
    line = _one_error_line(res)
    assert line == "lit-ess: error: model.optim.max_grad_norm must be > 0 or null, got -1.0: use null for no clipping", line


@pytest.mark.parametrize("key, value, says", CLASS_REFUSALS)
def test_a_class_path_refused_says_the_class_reason_and_a_missing_argument_its_full_key(read_in_one_process, key,
                                                                                         value, says):
    line = _one_error_line(read_in_one_process[("class", key, value)][0])
    assert line == f"lit-ess: error: {says}", line


def test_a_missing_environment_argument_in_a_config_file_is_named_by_its_full_key(read_in_one_process):
    line = _one_error_line(read_in_one_process[("class file",)][0])
    assert "data.init_args.env.env.init_args.function is required" in line, line


def test_missing_model_folder_says_how_to_make_one(tmp_path):
    res = cli(["fit", "--config", DEMO, "--model.init_args.model_path", "runs/nothing/here"], cwd=tmp_path)
    line = _one_error_line(res)
    assert "runs/nothing/here" in line and "lit-ess-tiny" in line and "huggingface.co" not in res.stderr


@pytest.mark.parametrize("args, says", UNKNOWN_ARGS)
def test_unknown_objectives_and_engines_list_the_known_ones(tiny_model_dir, read_in_one_process, args, says):
    key = ("unknown", *args)
    res = read_in_one_process[key][0] if key in read_in_one_process else cli(_demo_args(tiny_model_dir, *args))
    assert says in _one_error_line(res)


@pytest.mark.parametrize("key, value, says", UNKNOWN_FILES)
def test_unknown_classes_in_config_files_are_named_with_the_file(tiny_model_dir, read_in_one_process, tmp_path, key,
                                                                 value, says):
    if ("file", key) in read_in_one_process:
        res, path = read_in_one_process[("file", key)]
    else:
        path = _demo_config(tmp_path, tiny_model_dir, **{key: value})
        res = cli(["fit", "--config", path], cwd=tmp_path)
    line = _one_error_line(res)
    assert line.startswith(f"lit-ess: error: {path}: {says}"), line


def test_the_unknown_class_check_judges_only_lit_ess_fields(tmp_path):
    """Keys named engine/objective elsewhere (a prompt source's argument, a logger's) are not lit-ess's
    to judge; lit-ess's own fields are, in a config file and on the command line."""
    from lit_ess.config_check import check_inputs

    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  init_args:\n    source:\n      init_args: {engine: sqlite}\n")
    assert check_inputs(["--config", str(cfg), "--trainer.logger.init_args.objective=maximize"]) is None
    assert "is not a known objective" in check_inputs(["--model.init_args.objective=grpo"])
    cfg.write_text("data:\n  init_args:\n    engine: {class_path: lit_ess.engines.VLLMConfg}\n")
    assert "data.init_args.engine.class_path: 'lit_ess.engines.VLLMConfg' is not a known engine" in \
        check_inputs(["--config", str(cfg)])


def _run_demo_rl(tiny_model_dir, tmp_path, verbose: bool, config=DEMO, *extra):
    env = dict(os.environ, LIT_ESS_VERBOSE="1" if verbose else "0")
    res = cli(["fit", "--config", config, "--model.init_args.model_path", tiny_model_dir, "--trainer.max_steps", "2",
               "--data.init_args.batch.prompts_per_rollout", "8", "--data.init_args.batch.samples_per_prompt", "4", *extra],
              cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


@pytest.mark.e2e
def test_demo_console_is_quiet_and_verbose_brings_warnings_back(tiny_model_dir, tmp_path):
    quiet = _run_demo_rl(tiny_model_dir, tmp_path / "quiet", False, DEMO, "--trainer.check_val_every_n_epoch", "1",
                         "--data.init_args.validation.prompts", "16")
    console = quiet.stderr + quiet.stdout
    assert noisy_lines(console) == []
    assert "Total params" in console and "FLOPs" not in console      # the model summary, without uncounted FLOPs
    assert "steps: 100%" in quiet.stderr and "ess=" in quiet.stderr        # the progress bar, with ESS
    for step in (1, 2):                  # held-out numbers under the bar, also after the last step closed it
        assert re.search(rf"^  step {step}: val/pass@1 [\d.]+, val/pass@2 ", quiet.stderr, re.M), quiet.stderr[-3000:]
    table = read_texts(tmp_path / "quiet" / "runs/demo/rl/logs")["completions/text_summary"]
    assert table[0][0] == 0 and "| prompt | completion | reward | advantage | log pi_b |" in table[0][1]

    loud = _run_demo_rl(tiny_model_dir, tmp_path / "loud", verbose=True)
    assert re.search("warning", loud.stderr + loud.stdout, re.I)


@pytest.mark.e2e
def test_async_demo_console_is_quiet(tiny_model_dir, tmp_path):
    """The worker process (vLLM in a child) follows the same console rules as the trainer."""
    res = _run_demo_rl(tiny_model_dir, tmp_path, verbose=False, config=str(CONFIGS / "demo_async.yaml"))
    assert noisy_lines(res.stderr + res.stdout) == []
    assert "steps: 100%" in res.stderr
