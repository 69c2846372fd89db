"""An OpenEnv environment as a lit-ess environment (lit_ess.envs.openenv_env.OpenEnv): OpenEnv's own template
environment (an echo server, written by `openenv init`) played in process and through its server, and
configs/demo_openenv.yaml run by `lit-ess fit` for a few steps on the tiny model against that server, started
here and stopped after. Skipped without the `envs` extra (scripts/setup.sh installs it)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("openenv.core", reason="openenv-core is not installed: pip install 'lit-ess[envs]'")

from e2e_utils import cli, scalars, short_run, write_config  # noqa: E402

from lit_ess.envs.base import Action, Example  # noqa: E402
from lit_ess.envs.openenv_env import OpenEnv  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NAME = "echo_env"
ECHO, ACTION = f"{NAME}.server.{NAME}_environment:EchoEnvironment", f"{NAME}.models:EchoAction"


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """OpenEnv's template environment, as `openenv init` writes it (an echo: reward 0.1 per character), its
    folder on sys.path; the app's session limit raised so a phase's episodes fit (the template says to)."""
    root = tmp_path_factory.mktemp("openenv")
    res = subprocess.run([sys.executable, "-m", "openenv.cli", "init", NAME, "--output-dir", str(root)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    app = root / NAME / "server" / "app.py"
    text = app.read_text()
    assert "max_concurrent_envs=1," in text
    app.write_text(text.replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    sys.path.insert(0, str(root))
    yield root / NAME
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def server(echo_env):
    """The echo environment's server (uvicorn server.app:app in its folder) on a free port; stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(echo_env / "server.log", "wb")          # a file, not a pipe nobody reads (a full pipe blocks it)
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"], cwd=echo_env, env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (echo_env / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the echo server did not answer /health within 180 s"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_in_process_reset_and_step_are_the_turns(echo_env):
    env = OpenEnv(environment=ECHO, action=ACTION,
                  observation_field="echoed_message", template="{prompt} {observation}")
    assert env.reset(Example("go:", "")) == "go: Echo Env environment ready!"
    step = env.step(Action("hello", [1, 2], "stop"))
    assert (step.observation, step.reward, step.done) == ("hello", 0.5, False)
    whole = OpenEnv(environment=ECHO, action=ACTION)
    assert whole.reset(Example("", "")) == '{"echoed_message":"Echo Env environment ready!","message_length":0}'


class SeededEnv:
    """An OpenEnv-shaped environment whose start state is its reset's seed (as random-start environments draw
    theirs), and its Action."""
    def __init__(self):
        self.seed = None

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.seed = seed
        return _Observation(start=seed)

    def step(self, action):
        return _Observation(start=self.seed)


class _Observation:
    def __init__(self, start):
        self.start, self.reward, self.done = start, 0.0, False

    def model_dump(self):
        return {"start": self.start}


class SeededAction:
    def __init__(self, message):
        self.message = message


def test_a_groups_episodes_start_from_the_same_state_and_prompts_from_their_own():
    """Each episode is its own environment; a group's n episodes share their example, so their resets get the same
    seed (their advantages compare one task), another prompt another (failed before: no seed, every episode drew
    its own start). A seed in `reset` is kept; an environment whose reset takes none is given none (the echo)."""
    def start(example, **kw):
        return OpenEnv(environment="test_openenv:SeededEnv", action="test_openenv:SeededAction", **kw).reset(example)
    a, b = Example("1+1=", "2"), Example("2+2=", "4")
    assert start(a) == start(a) != start(b)
    assert start(a, reset={"seed": 7}) == start(b, reset={"seed": 7}) == '{"start":7}'


def test_server_sessions_are_the_turns(server):
    import threading

    env = OpenEnv(base_url=server, observation_field="echoed_message")
    assert env.reset(Example("", "")) == "Echo Env environment ready!"
    out = []                       # the runner steps each turn in a thread of its own
    t = threading.Thread(target=lambda: out.append(env.step(Action("four", [1], "stop"))))
    t.start(), t.join()
    assert (out[0].observation, out[0].reward, out[0].done) == ("four", 0.4, False)
    env.close()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give base_url (a running server) or environment"),
    ({"base_url": "http://x", "environment": "a:B", "action": "a:C"}, "give base_url (a running server) or environment"),
    ({"environment": "a:B"}, "OpenEnv.action names the Action class"),
    ({"base_url": "http://x", "timeout": 0}, "OpenEnv.timeout must be > 0 seconds"),
    ({"base_url": "http://x", "template": "{obs}"}, "takes {observation} and {prompt} only"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match="^OpenEnv") as e:
        OpenEnv(**kwargs)
    assert message in str(e.value)


@pytest.mark.e2e
def test_demo_openenv_trains_against_the_server(server, tiny_model_dir, tmp_path):
    """configs/demo_openenv.yaml against the echo server, smaller (4 prompts x 4 episodes, 3 steps) on the tiny
    model: two turns per episode (the echo never ends: the runner's limit does), the echoed text is context,
    the rewards are the server's, and every step is on-policy."""
    cfg = yaml.safe_load((CONFIGS / "demo_openenv.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    d = cfg["data"]["init_args"]
    d["batch"].update(prompts_per_rollout=4, samples_per_prompt=4)
    d["env"]["env"]["init_args"]["base_url"] = server
    short_run(cfg, tmp_path, max_steps=3)
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess = [v for _, v in s["train/ess"]]
    assert len(ess) == 3 and min(ess) >= 0.9999, ess
    assert [v for _, v in s["rollout/turns"]] == [2.0] * 3
    assert [v for _, v in s["rollout/truncated_turns"]] == [16.0] * 3
    assert min(v for _, v in s["rollout/env_tokens"]) > 0 and max(v for _, v in s["rollout/env_errors"]) == 0
    assert min(v for _, v in s["rollout/reward_mean"]) > 0          # 0.1 per character the policy wrote
    assert sum(v > 0 for _, v in s["train/grad_norm"]) == 3
