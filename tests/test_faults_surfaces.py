"""Faults of the newer surfaces (issue 38): resume with other knobs or another model, config files that do
not parse, servers by URL that do not answer as vLLM does, timeouts named by their knob, a launched server's
port held by another service."""
import os
import re
import threading
import time

import pytest
import torch

from agent_fns import HTTPFailure, post
from e2e_utils import cli, cli_each, rl_config, write_config
from test_faults_state import fault_line
from test_server import FakeVLLM, fake_server  # noqa: F401  (a fixture)

from lit_ess.engines import VLLMServerConfig
from lit_ess.engines.server_pool import ServerError, ServerGone
from lit_ess.sampling import SamplingConfig


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
    trained GRPO). A knob a resume may change (micro_batch.size) resumes, with the config's value."""
    cfg, tmp = p3o_run
    first = next((tmp / "ckpt").glob("*step=1.ckpt"))
    cfg = {**cfg, "trainer": {**cfg["trainer"], "max_steps": 3}}
    changed = {**cfg, "model": {**cfg["model"], "init_args": {**cfg["model"]["init_args"], "optim": {"lr": 5e-4},
               "objective": {"class_path": "lit_ess.objectives.GRPO"}}}}
    path = str(write_config(changed, tmp / "grpo.yaml"))
    runs = cli_each({form: (["fit", "--config", path, "--ckpt_path", ckpt], tmp)
                     for form, ckpt in (("path", str(first)), ("last", "last"))}, timeout=600)
    for form, res in runs.items():
        line = fault_line(res, code=2)
        assert "model.objective P3O -> GRPO" in line and "model.optim.lr 0.001 -> 0.0005" in line, (form, line)
        assert str(first if form == "path" else tmp / "ckpt" / "last.ckpt") in line, (form, line)
    assert not list((tmp / "ckpt").glob("*step=3.ckpt"))
    memory = {**cfg, "model": {**cfg["model"], "init_args": {**cfg["model"]["init_args"], "micro_batch": {"size": 8}}}}
    res = cli(["fit", "--config", str(write_config(memory, tmp / "mbs.yaml")), "--ckpt_path", str(first)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = torch.load(next((tmp / "ckpt").glob("*step=3.ckpt")), weights_only=False)["hyper_parameters"]
    assert saved["micro_batch"]["size"] == 8 and saved["optim"]["lr"] == 1e-3


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


# ---------------------------------------------------------------- servers by URL (answers faked: tests/test_server.py)

@pytest.mark.parametrize("route, answer", [
    ("/version", []), ("/version", {"detail": "Not Found"}), ("/server_info", []), ("/server_info", {"vllm_config": []}),
    ("/v1/models", []), ("/v1/models", {"data": {}}), ("/weight_info", []), ("/weight_info", {})])
def test_a_url_that_does_not_answer_as_vllm_is_one_line_naming_it(route, answer, fake_server, tiny_model_dir):
    """A service by URL answering what vLLM does not (main: AttributeError or TypeError tracebacks, or a
    'runs vLLM ?' that blames the version): one line naming the URL, the call and its answer."""
    FakeVLLM.answers = {route: (200, answer)}
    with pytest.raises(ServerError, match=rf"vLLM server {fake_server}: GET {re.escape(route)}\S* answered .*, not what "
                                          rf"vLLM 0\.32\.x answers: is {fake_server} a vLLM server") as e:
        VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("answer", [{"choices": []}, {"choices": [{"token_ids": None}]}, []])
def test_a_generate_answer_that_is_not_vllms_is_one_line_naming_the_url(answer, fake_server, tiny_model_dir):
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    FakeVLLM.answers = {"/inference/v1/generate": (200, answer)}
    try:
        with pytest.raises(ServerError, match=rf"vLLM server {fake_server}: POST /inference/v1/generate \(prompt 0, "
                                              rf"1 sample\(s\)[^)]*\) answered .*, not what vLLM 0\.32\.x answers") as e:
            engine.generate([[1, 2]], 1, SamplingConfig(seed=0))
        assert "\n" not in str(e.value)
    finally:
        engine.close()


@pytest.mark.e2e
def test_fit_on_a_url_answering_empty_lists_is_one_line(fake_server, tiny_model_dir, tmp_path):
    """`lit-ess fit` with engine.urls at a service answering `[]` to everything (main: `AttributeError: 'list'
    object has no attribute 'get'`, a bare traceback)."""
    FakeVLLM.answers = {route: (200, []) for route in FakeVLLM.defaults}
    cfg = rl_config(tiny_model_dir, tmp_path, engine="VLLMServerConfig", max_steps=1)
    cfg["data"]["init_args"]["engine"]["init_args"] = {"urls": [fake_server], "startup_timeout": 10}
    line = fault_line(cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], timeout=300))
    assert f"vLLM server {fake_server}: GET /version answered [], not what vLLM 0.32.x answers" in line, line


# ---------------------------------------------------------------- config files

def test_a_config_that_is_not_yaml_names_the_file_the_line_and_the_cause(tiny_model_dir, tmp_path):
    """A tab in the indentation, and an unclosed bracket (main: `Problems parsing config: while scanning for the
    next token`, neither the file nor the line)."""
    good = write_config(rl_config(tiny_model_dir, tmp_path, engine="HFConfig"), tmp_path / "good.yaml").read_text()
    lines = good.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("max_steps:"))
    tab = tmp_path / "tab.yaml"
    tab.write_text("\n".join(lines[:at] + ["\t" + lines[at].lstrip()] + lines[at + 1:]) + "\n")
    bracket = tmp_path / "bracket.yaml"
    bracket.write_text(good.replace("max_steps: 4", "max_steps: [4", 1))
    runs = cli_each({k: (["fit", "--config", str(p)], tmp_path) for k, p in (("tab", tab), ("bracket", bracket))})
    line = fault_line(runs["tab"], code=2)
    assert line == (f"lit-ess: error: {tab} line {at + 1}: a tab in the indentation (YAML indents with spaces only): "
                    f"replace it with spaces"), line
    line = fault_line(runs["bracket"], code=2)
    assert re.fullmatch(rf"lit-ess: error: {re.escape(str(bracket))} line {at + 2} column \d+: expected ',' or ']', .*"
                        rf"\(while parsing a flow sequence at line {at + 1}\)", line), line


# ---------------------------------------------------------------- timeouts

def test_a_silent_url_at_start_names_startup_timeout(tiny_model_dir):
    """A service that accepts connections and never answers: the start-up check gives up after startup_timeout
    and says so (main: `(engine.control_timeout)`)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ServerGone, match=rf"vLLM server {url}: GET /version got no answer in 2 s "
                                             rf"\(engine\.startup_timeout\)") as e:
            VLLMServerConfig(urls=[url], startup_timeout=2, control_timeout=30).build(tiny_model_dir)
    assert "\n" not in str(e.value)


class SlowPause(FakeVLLM):
    """A faked server whose POST /pause answers after 6 s (a drain that waits for long requests)."""

    def do_POST(self):
        if self.path.startswith("/pause"):
            import time

            time.sleep(6)
        self._answer()


def test_a_drained_pause_names_request_timeout(fake_server, tiny_model_dir):
    """weight_update: drain waits up to request_timeout for the running requests: a pause not answered in that
    time names request_timeout (main: `(engine.control_timeout)`)."""
    from test_server import start_fake, stop_fake
    from transformers import AutoModelForCausalLM

    url, httpd = start_fake(SlowPause)
    engine = VLLMServerConfig(urls=[url], startup_timeout=10, request_timeout=2, control_timeout=30).build(tiny_model_dir)
    try:
        with pytest.raises(ServerGone, match=rf"vLLM server {url}: POST /pause\?mode=wait got no answer in 2 s "
                                             rf"\(engine\.request_timeout\)"):
            engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items(), version=1)
    finally:
        engine.close()
        stop_fake(httpd)


# ---------------------------------------------------------------- agents

BAD_IDS: dict = {}


def posts_ids_outside_the_vocabulary(url, example):
    """An agent that posts token ids the policy does not have, swallows the refusal and claims reward 1."""
    try:
        post(url + "/completions", {"prompt": [1000000, 300, 5]})
    except HTTPFailure as e:
        BAD_IDS["said"] = str(e)
    return 1.0


def test_prompt_ids_outside_the_vocabulary_are_http_400_and_fail_the_episode(tiny_model_dir):
    """With the hf engine (main: an IndexError inside the engine that ended the run; vLLM's
    VLLMValidationError did the same): HTTP 400 to the agent, and its episode fails (reward 0, counted)."""
    from test_agents import run
    from transformers import AutoTokenizer

    from lit_ess.datamodules.prompts import Example
    from lit_ess.engines import HFConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fn = "test_faults_surfaces:posts_ids_outside_the_vocabulary"
    with pytest.warns(UserWarning, match=f"agent '{fn}' failed in an episode"):
        (e,), runner = run(fn, tok, HFConfig().build(tiny_model_dir), [Example("1+1=", "2")])
    said = f"HTTP 400: agent '{fn}' posted token ids outside the policy's vocabulary (0..{len(tok) - 1}) at call 1: " \
           f"[1000000, 300]"
    assert BAD_IDS["said"] == said, BAD_IDS
    assert (e.reward, e.env_errors, runner.errors) == (0.0, 1, 1) and "outside the policy's vocabulary" in e.error


# ---------------------------------------------------------------- environments

@pytest.mark.e2e
def test_a_long_first_observation_is_cut_to_max_prompt_tokens_and_counted(tiny_model_dir, tmp_path):
    """An environment whose reset returns 5,000 tokens for about half the examples, max_prompt_tokens 64 (hf
    engine): those episodes are not played, their rows hold at most 64 prompt tokens, and they are counted in
    rollout/truncated_prompts (main: 5,000-token rows, trained on whole)."""
    from e2e_utils import scalars

    env = {"env": {"class_path": "e2e_utils.LongFirstObservation", "init_args": {"length": 5000}}, "max_turns": 2}
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=8, samples=2,
                    extra_data={"env": env, "max_prompt_tokens": 64, "reward_limits": {"max_error_rate": 1.0}})
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordRowLengths",
                                        "init_args": {"path": str(tmp_path / "rows.txt")}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    widest = [int(x) for x in (tmp_path / "rows.txt").read_text().split()]
    assert len(widest) == 2 and max(widest) <= 64, widest
    cut = [v for _, v in scalars(tmp_path)["rollout/truncated_prompts"]]
    assert len(cut) == 2 and all(v % 2 == 0 for v in cut) and sum(cut) >= 2, cut     # whole groups of 2


# ---------------------------------------------------------------- a launched server's port

class Unrelated(FakeVLLM):
    """An HTTP service that is not vLLM: 200 and a line of text on every route."""
    defaults: dict = {}
    answers = {"/health": (200, "ok"), "/version": (200, "an unrelated service")}


@pytest.mark.e2e
def test_fit_with_another_service_on_the_launched_servers_port_is_one_line_naming_it(tiny_model_dir, tmp_path):
    """`engine.port: P` while an unrelated HTTP service listens on P (main: its first /health 200 was taken for
    the launched server's, and the run failed blaming a 'vLLM ?' or an answer that is no JSON): exit 2, one line
    naming the port, who holds it (this test's process) and the knob to change; no server is launched."""
    from test_server import _fake_on, stop_fake

    from lit_ess.engines.server_launch import free_port

    port = free_port()
    httpd = _fake_on(port, Unrelated)
    try:
        cfg = rl_config(tiny_model_dir, tmp_path, engine="VLLMServerConfig", max_steps=1)
        cfg["data"]["init_args"]["engine"]["init_args"] = {"port": port, "startup_timeout": 60,
                                                           "log_file": str(tmp_path / "server.log")}
        line = fault_line(cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], timeout=300), code=2)
    finally:
        stop_fake(httpd)
    # the holder's command line as ps shows it (under pytest-xdist its process title, not "python ...")
    assert re.search(rf"engine\.port {port}: 127\.0\.0\.1:{port} is in use by pid {os.getpid()} \(.+\): "
                     rf"a launched server needs a port of its own: set another engine\.port, or port: null", line), line
    assert "vLLM 0" not in line and not (tmp_path / "server.log").exists()


def test_a_service_that_takes_the_port_during_start_up_is_not_taken_for_the_launched_server(fake_server,
                                                                                          tiny_model_dir, tmp_path):
    """The port is free when checked, and a faked vLLM (one that passes every start-up check) binds it while the
    launched server starts (main: its /health 200 made it the run's server, and the run used it): the readiness
    check finds that the answer is not from the server launched, in one line naming the port; the launched
    server is stopped."""
    from test_server import _fake_on, stop_fake, vllm_children

    from lit_ess.engines.server_launch import free_port

    port, log, taken = free_port(), tmp_path / "server.log", {}

    def take_the_port():             # once the server is launched (its log exists), before vLLM binds (>5 s here)
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        taken["httpd"] = _fake_on(port)

    thread = threading.Thread(target=take_the_port)
    thread.start()
    try:
        with pytest.raises(ServerError, match=rf"vLLM server http://127\.0\.0\.1:{port}.*: GET /health answered "
                                              rf"200 from another process than the server launched \(pid \d+\): "
                                              rf"127\.0\.0\.1:{port} is in use by pid {os.getpid()} ") as e:
            VLLMServerConfig(port=port, startup_timeout=60, log_file=str(log)).build(tiny_model_dir)
        assert "\n" not in str(e.value)
    finally:
        thread.join()
        if "httpd" in taken:
            stop_fake(taken["httpd"])
    assert vllm_children(os.getpid()) == []
