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


PRINTED = [(), ("--model.init_args.packing", "true", "--model.init_args.micro_batch_tokens", "512"),
           ("--data.init_args.engine", "HFConfig")] + [("--model.init_args.objective", c.__name__) for c in OBJECTIVE_CLASSES]
OLD_ARGS = [
    (["--model.init_args.objective", "grpo"], "old string form; write `objective: {class_path: lit_ess.objectives.GRPO}`"),
    (["--data.init_args.engine", "hf"], "old string form; write `engine: {class_path: lit_ess.engines.HFConfig}`"),
    (["--model.init_args.objective", "PPO9000"], "choose one of P3O, P4O, GRPO, DAPO, GSPO, CISPO, DecoupledPPO, REINFORCE"),
    (["--model.init_args.objective_kwargs", "{clip_eps: 0.3}"], "objective_kwargs is gone"),
]
OLD_FILES = [
    ("model.init_args.objective", "grpo", "model.init_args.objective: 'grpo' is the old string form; "
                                          "write `objective: {class_path: lit_ess.objectives.GRPO}`"),
    ("model.init_args.objective_kwargs", {"clip_eps": 0.3}, "model.init_args.objective_kwargs is gone: give the "
                                                            "objective as `objective: {class_path: lit_ess.objectives"),
    ("data.init_args.engine", "vllm", "data.init_args.engine: 'vllm' is the old string form; "
                                      "write `engine: {class_path: lit_ess.engines.VLLMConfig}`"),
    ("data.init_args.engine_kwargs", {"dtype": "bfloat16"}, "data.init_args.engine_kwargs is gone: give the engine as "
                                                           "`engine: {class_path: lit_ess.engines.VLLMConfig"),
]
MOVED_PATHS = [("trainer.callbacks.0.class_path", "callbacks.WeightSync"), ("data.class_path", "datamodules.RolloutDataModule")]
CWDS = ["elsewhere", "repo root"]


def _cwd(where: str, folder: Path) -> Path:
    return folder if where == "elsewhere" else CONFIGS.parent


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
    cases[("max_grad_norm",)] = (_demo_args(tiny_model_dir, "--model.init_args.max_grad_norm", "-1"), None)
    for args, _ in OLD_ARGS[1:]:
        cases[("old", *args)] = (_demo_args(tiny_model_dir, *args), None)
    for i, (key, value, _) in enumerate(OLD_FILES[1:]):
        files[("file", key)] = _demo_config(tmp / f"file{i}", tiny_model_dir, **{key: value})
        cases[("file", key)] = (["fit", "--config", files[("file", key)]], tmp / f"file{i}")
    for i, (key, old) in enumerate(MOVED_PATHS):
        for where in CWDS[1:] if i == 0 else CWDS:
            folder = tmp / f"moved{i}-{where.replace(' ', '-')}"
            files[("moved", key, where)] = _demo_config(folder, tiny_model_dir, **{key: old})
            cases[("moved", key, where)] = (["fit", "--config", files[("moved", key, where)]], _cwd(where, folder))
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


def test_print_config_lists_the_token_knobs(read_in_one_process):
    """micro_batch_tokens and packing are in the printed config, with their defaults, and take a value."""
    model = print_config(read_in_one_process)["model"]["init_args"]
    assert model["micro_batch_tokens"] is None and model["packing"] is False
    model = print_config(read_in_one_process, "--model.init_args.packing", "true",
                         "--model.init_args.micro_batch_tokens", "512")["model"]["init_args"]
    assert model["packing"] is True and model["micro_batch_tokens"] == 512


def test_print_config_lists_engine_settings(read_in_one_process):
    cfg = print_config(read_in_one_process, "--data.init_args.engine", "HFConfig")
    assert cfg["data"]["init_args"]["engine"] == {"class_path": "lit_ess.engines.HFConfig",
                                                  "init_args": {"dtype": "float32", "device": "cpu", "batch_size": 256,
                                                                "behavior_logprobs": "processed"}}
    vllm = print_config(read_in_one_process)["data"]["init_args"]["engine"]["init_args"]
    assert {"dtype", "gpu_memory_utilization", "kv_cache_gib", "max_model_len", "enforce_eager", "seed",
            "behavior_logprobs", "vllm_kwargs", "worker_devices", "transport", "bucket_mb", "max_lora_rank"} == set(vllm)
    assert (vllm["worker_devices"], vllm["transport"]) == (None, "shared_memory")   # colocated by default


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
    assert line == "lit-ess: error: model.max_grad_norm must be > 0 or null, got -1.0: use null for no clipping", line


def test_missing_model_folder_says_how_to_make_one(tmp_path):
    res = cli(["fit", "--config", DEMO, "--model.init_args.model_path", "runs/nothing/here"], cwd=tmp_path)
    line = _one_error_line(res)
    assert "runs/nothing/here" in line and "lit-ess-tiny" in line and "huggingface.co" not in res.stderr


@pytest.mark.parametrize("args, says", OLD_ARGS)
def test_old_configs_say_how_to_update(tiny_model_dir, read_in_one_process, args, says):
    key = ("old", *args)
    res = read_in_one_process[key][0] if key in read_in_one_process else cli(_demo_args(tiny_model_dir, *args))
    assert says in _one_error_line(res)


@pytest.mark.parametrize("key, value, says", OLD_FILES)
def test_old_config_files_say_how_to_update(tiny_model_dir, read_in_one_process, tmp_path, key, value, says):
    if ("file", key) in read_in_one_process:
        res, path = read_in_one_process[("file", key)]
    else:
        path = _demo_config(tmp_path, tiny_model_dir, **{key: value})
        res = cli(["fit", "--config", path], cwd=tmp_path)
    line = _one_error_line(res)
    assert line.startswith(f"lit-ess: error: {path}: {says}"), line


@pytest.mark.parametrize("cwd", CWDS)
@pytest.mark.parametrize("key, old", MOVED_PATHS)
def test_moved_class_paths_say_the_new_one(tiny_model_dir, read_in_one_process, tmp_path, cwd, key, old):
    """From a checkout's root `import callbacks` would succeed: the old path must still be refused."""
    if ("moved", key, cwd) in read_in_one_process:
        res, path = read_in_one_process[("moved", key, cwd)]
    else:
        path = _demo_config(tmp_path, tiny_model_dir, **{key: old})
        res = cli(["fit", "--config", path], cwd=_cwd(cwd, tmp_path), timeout=120)
    line = _one_error_line(res)
    assert line == f"lit-ess: error: {path}: {key}: {old!r} moved; write 'lit_ess.{old}' (callbacks/ and " \
                   "datamodules/ are installed in lit_ess)", line


def test_the_old_form_check_judges_only_lit_ess_fields(tmp_path, monkeypatch):
    """Keys named engine/objective elsewhere, and a user's own module named callbacks, are not legacy
    forms; lit-ess's own fields still are."""
    from lit_ess.callbacks import __all__ as ours
    from lit_ess.config_check import check_inputs

    moved = {"callbacks": list(ours)}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  init_args:\n    source:\n      init_args: {engine: sqlite}\n")
    assert check_inputs(["--config", str(cfg), "--trainer.logger.init_args.objective=maximize"], moved) is None
    assert "old string form" in check_inputs(["--model.init_args.objective=grpo"], moved)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "callbacks.py").write_text("class ExportHF:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mine"))
    assert check_inputs(["--trainer.callbacks+=callbacks.ExportHF"], moved) is None


def test_moved_class_path_on_the_command_line(tiny_model_dir):
    res = cli(_demo_args(tiny_model_dir, "--trainer.callbacks+=callbacks.LogCompletions"), cwd=CONFIGS.parent, timeout=120)
    assert "'callbacks.LogCompletions' moved; write 'lit_ess.callbacks.LogCompletions'" in _one_error_line(res)


def test_old_weight_sync_period_says_what_to_use(tiny_model_dir, tmp_path):
    cfg = yaml.safe_load(open(DEMO))
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    cfg["trainer"]["callbacks"][0] = {"class_path": "lit_ess.callbacks.WeightSync", "init_args": {"every_n_steps": 4}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(cfg))
    line = _one_error_line(cli(["fit", "--config", str(path)], cwd=tmp_path))
    assert "every_n_steps=4 is gone" in line and "max_staleness" in line, line


def _run_demo_rl(tiny_model_dir, tmp_path, verbose: bool, config=DEMO, *extra):
    env = dict(os.environ, LIT_ESS_VERBOSE="1" if verbose else "0")
    res = cli(["fit", "--config", config, "--model.init_args.model_path", tiny_model_dir, "--trainer.max_steps", "2",
               "--data.init_args.prompts_per_rollout", "8", "--data.init_args.samples_per_prompt", "4", *extra],
              cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


@pytest.mark.e2e
def test_demo_console_is_quiet_and_verbose_brings_warnings_back(tiny_model_dir, tmp_path):
    quiet = _run_demo_rl(tiny_model_dir, tmp_path / "quiet", False, DEMO, "--trainer.check_val_every_n_epoch", "1",
                         "--data.init_args.val_prompts", "16")
    console = quiet.stderr + quiet.stdout
    assert noisy_lines(console) == []
    assert "Total params" in console and "FLOPs" not in console      # the model summary, without uncounted FLOPs
    assert "steps: 100%" in quiet.stderr and "ess=" in quiet.stderr        # the progress bar, with ESS
    for step in (1, 2):                  # held-out numbers under the bar, also after the last step closed it
        assert re.search(rf"^  step {step}: val/pass@1 [\d.]+, val/pass@2 ", quiet.stderr, re.M), quiet.stderr[-3000:]
    table = read_texts(tmp_path / "quiet" / "runs/demo/tb/rl")["completions/text_summary"]
    assert table[0][0] == 0 and "| prompt | completion | reward | advantage | log pi_b |" in table[0][1]

    loud = _run_demo_rl(tiny_model_dir, tmp_path / "loud", verbose=True)
    assert re.search("warning", loud.stderr + loud.stdout, re.I)


@pytest.mark.e2e
def test_async_demo_console_is_quiet(tiny_model_dir, tmp_path):
    """The worker process (vLLM in a child) follows the same console rules as the trainer."""
    res = _run_demo_rl(tiny_model_dir, tmp_path, verbose=False, config=str(CONFIGS / "demo_async.yaml"))
    assert noisy_lines(res.stderr + res.stdout) == []
    assert "steps: 100%" in res.stderr
