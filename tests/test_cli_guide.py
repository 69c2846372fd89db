"""What `lit-ess` tells its user besides the run (lit_ess/guide.py), as the user meets it: its own --help,
the lit-ess knobs at the top of `fit --help`, one line for `test`/`predict`, "did you mean" for a
mistyped key or subcommand, the console while a launched vLLM server starts, and the block at the end
of `fit` that says where the checkpoint, the exported model and the logs went."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from e2e_utils import cli, cli_each, rl_config, write_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO = str(CONFIGS / "demo.yaml")


def test_help_is_lit_ess_own():
    """`lit-ess --help`: what lit-ess is, the commands to run first, where the docs are, and only the
    subcommands that work."""
    res = cli(["--help"])
    assert res.returncode == 0, res.stderr[-2000:]
    text = res.stdout
    assert text.startswith("usage: lit-ess ") and "Lightning Trainer command line tool" not in text
    assert "RL post-training of language models" in text and "First commands:" in text
    assert "lit-ess fit --config configs/demo.yaml" in text and "Docs: docs/quickstart.md" in text
    listed = re.search(r"Available subcommands:(.*)", text, re.S).group(1)
    assert re.search(r"^\s+fit\s", listed, re.M) and re.search(r"^\s+validate\s", listed, re.M)
    assert not re.search(r"^\s+(test|predict)\s", listed, re.M), listed


@pytest.fixture(scope="module")
def read(tiny_model_dir, tmp_path_factory):
    """Each case below, read and refused (or its help printed) in one process (e2e_utils.cli_each)."""
    tmp = tmp_path_factory.mktemp("guide")
    cfg = yaml.safe_load(open(DEMO))
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    optim = cfg["model"]["init_args"]["optim"]
    optim["lrr"] = optim.pop("lr")                                                   # a typo in the file
    typo = write_config(cfg, tmp / "typo.yaml")
    demo = ["--config", DEMO, "--model.init_args.model_path", tiny_model_dir]
    cases = {
        "fit --help": (["fit", "--help"], None),
        "print_config": (["fit", *demo, "--print_config"], None),
        "test": (["test", *demo], None),
        "predict": (["predict", *demo], None),
        "file typo": (["fit", "--config", str(typo)], None),
        "trainer typo": (["fit", *demo, "--trainer.max_stepz", "2"], None),
        "nested typo": (["fit", *demo, "--data.init_args.sampling.temprature", "0.7"], None),
        "objective typo": (["fit", *demo, "--model.init_args.objective", "GRPO",
                           "--model.init_args.objective.init_args.clip_epz", "0.3"], None),
        "far off": (["fit", *demo, "--data.init_args.zzzzzz", "1"], None),
        "group left out": (["fit", *demo, "--model.init_args.lrr", "0.1"], None),
        "data group left out": (["fit", *demo, "--data.init_args.samples_per_promt", "4"], None),
        "group's exact field": (["fit", *demo, "--data.init_args.samples", "2"], None),
        "two groups' field": (["fit", *demo, "--data.init_args.enable", "true"], None),
        "a field another key ends in": (["fit", *demo, "--model.init_args.dtype", "float32"], None),
        "a field of a group that is off": (["fit", *demo, "--model.init_args.dropout", "0.1"], None),
        "a field of the class chosen": (["fit", *demo, "--model.init_args.ess_cap", "false"], None),
        "init_args in a plain group": (["fit", *demo, "--model.init_args.optim.init_args.lr", "0.1"], None),
        "a field of a group set on": (["fit", *demo, "--model.init_args.lora.rank", "8", "--model.init_args.dropout", "0.1"],
                                      None),
        "subcommand typo": (["fitt", *demo], None),
        "no subcommand": ([], None),
    }
    return {k: res for k, res in cli_each(cases).items()}


def test_fit_help_starts_with_the_lit_ess_knobs(read):
    """The lit-ess knobs are in the first lines of `fit --help`, before Lightning's Trainer flags."""
    res = read["fit --help"]
    assert res.returncode == 0, res.stderr[-2000:]
    head = res.stdout.splitlines()[:15]
    assert head[0] == "usage: lit-ess [options] fit --config CONFIG [--KEY VALUE ...] [--print_config]", head[0]
    assert any("--model.help PolicyModule" in ln for ln in head) and any("--data.help RolloutDataModule" in ln
                                                                         for ln in head), "\n".join(head)
    assert "--trainer.max_steps" in res.stdout                 # Lightning's flags are still listed, below
    assert any("--output_dir DIR" in ln for ln in head), "\n".join(head)
    assert re.search(r"--output_dir OUTPUT_DIR\s+The run's folder \(null = none", res.stdout), res.stdout[:3000]
    assert re.search(r"--overwrite \{true,false\}\s+Start over in an output_dir", res.stdout), res.stdout[:3000]


def test_print_config_still_prints_the_config(read):
    res = read["print_config"]
    assert res.returncode == 0, res.stderr[-2000:]
    assert yaml.safe_load(res.stdout)["model"]["init_args"]["optim"]["lr"] == 2.0e-4


@pytest.mark.parametrize("command", ["test", "predict"])
def test_test_and_predict_are_refused_in_one_line(read, command):
    res = read[command]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [res.stderr.strip()], res.stderr
    assert res.stderr.startswith(f"lit-ess: error: `lit-ess {command}` is not offered") and "lit-ess validate" in res.stderr


@pytest.mark.parametrize("case, says", [
    ("file typo", "Group 'optim' does not accept option 'lrr'; did you mean model.init_args.optim.lr?"),
    ("trainer typo", "did you mean trainer.max_steps?"),
    ("nested typo", "did you mean data.init_args.sampling.temperature?"),
    ("group left out", "did you mean model.init_args.optim.lr?"),
    ("data group left out", "did you mean data.init_args.batch.samples_per_prompt?"),
    ("group's exact field", "did you mean data.init_args.validation.samples?"),        # not sampling
    ("init_args in a plain group", "did you mean model.init_args.optim.lr?"),
    ("a field of a group set on", "did you mean model.init_args.lora.dropout?"),
    ("a field of the class chosen", "did you mean model.init_args.objective.init_args.ess_cap?"),     # P3O's
    ("a field of a group that is off",
     "did you mean model.init_args.lora.dropout (this turns lora on: it is null by default)?"),
    ("a field another key ends in", "did you mean model.init_args.compute.dtype?"),   # not data's engine.dtype
    ("two groups' field", "did you mean data.init_args.dynamic_sampling.enable or data.init_args.overlong.enable?"),
    ("objective typo", "did you mean model.init_args.objective.init_args.clip_eps?"),
    ("subcommand typo", "invalid choice: 'fitt' (choose from 'fit', 'validate'); did you mean 'fit'?"),
    ("no subcommand", "but it was not provided: `lit-ess --help` says what to run first"),
])
def test_a_mistyped_key_or_subcommand_gets_did_you_mean(read, case, says):
    res = read[case]
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("lit-ess: error:")]
    assert len(errors) == 1 and says in errors[0], res.stderr[-2000:]


def test_no_suggestion_for_a_key_close_to_none(read):
    res = read["far off"]
    assert res.returncode == 2 and "zzzzzz" in res.stderr and "did you mean" not in res.stderr, res.stderr[-2000:]


def test_a_launched_server_says_its_url_log_and_wait(tmp_path, monkeypatch, capsys):
    """While a launched server starts: its URL and log file at once, then the seconds waited every
    STARTUP_PROGRESS_S (the engine says when it is ready). The server here answers after 2.5 s."""
    from lit_ess.engines import server_launch
    from lit_ess.engines.server_launch import LaunchedServer, free_port

    monkeypatch.setattr(server_launch, "STARTUP_PROGRESS_S", 1.0)
    port = free_port()
    script = ("import http.server, time\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers()\n"
              "time.sleep(2.5)\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    log = tmp_path / "server.log"
    server = LaunchedServer([sys.executable, "-c", script], {}, str(log), f"http://127.0.0.1:{port}")
    try:
        server.wait_ready(timeout=60)
    finally:
        server.stop()
    err = capsys.readouterr().err
    url = f"http://127.0.0.1:{port}"
    assert f"lit-ess: starting a vLLM server at {url} (log: {log})" in err, err
    waits = re.findall(rf"lit-ess: waiting for the vLLM server at {re.escape(url)}: (\d+) s", err)
    assert len(waits) >= 2 and [int(w) for w in waits] == sorted(int(w) for w in waits), err


@pytest.mark.e2e
def test_fit_ends_with_where_the_checkpoint_export_and_logs_went(tiny_model_dir, tmp_path):
    """One step with the transformers engine, a ModelCheckpoint, ExportHF and TensorBoard: the console's
    last block names the checkpoint file, the exported folder and the log folder, all of which exist."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=1, ckpt_every=1, prompts=4, samples=2)
    cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.ExportHF",
                                        "init_args": {"dirpath": str(tmp_path / "export")}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    block = res.stderr[res.stderr.index("lit-ess: fit done at step 1:"):].splitlines()
    rows = {ln.split()[0]: tmp_path / ln.split()[1] for ln in block[1:] if ln.startswith("  ")}   # relative to cwd
    assert set(rows) == {"checkpoint", "model", "logs"}, block
    assert rows["checkpoint"].is_file() and rows["checkpoint"].parent == tmp_path / "ckpt", block
    assert rows["model"] == tmp_path / "export" and (rows["model"] / "config.json").is_file(), block
    assert rows["logs"] == tmp_path / "tb" / "run" and any(rows["logs"].iterdir()), block
