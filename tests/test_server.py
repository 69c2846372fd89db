"""vLLM's own server as the rollout engine (lit_ess.engines.VLLMServerConfig): one server for the whole
module (its start takes 60-140 s here), started by the documented command (`python -m
lit_ess.engines.serve`) on the tiny model as a fleet's server (every interface, the shared token) and used
by URL; one more launched by `lit-ess fit` itself and
killed mid-run; the identity checks and faults against HTTP answers faked by a small local server
(starting vLLM once per refusal would cost minutes)."""
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from e2e_utils import cli, pythonpath, rl_config, scalars, write_config
from test_engines import PROMPTS, max_logprob_gap
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_ess.engines import VLLMServerConfig
from lit_ess.sampling import SamplingConfig, group_seed
from lit_ess.engines.vllm_engine import adapter_root
from lit_ess.engines.server_launch import LaunchedServer, free_port, served_model_name, server_command, server_env
from lit_ess.engines.server_pool import ServerError, ServerGone
from lit_ess.engines.vllm_server import WEIGHTS_PREFIX, FollowerConfig, LeaderConfig
from lit_ess.logprobs import sequence_logprobs
from lit_ess.datamodules.settings import BatchShape, Schedule


# ---- fast: knobs, command, identity checks against faked answers ----

@pytest.mark.parametrize("kwargs, says", [
    ({"urls": ["localhost:8000"]}, "urls"), ({"urls": ["http://a:1", "http://a:1"]}, "twice"),
    ({"dtype": "fp8"}, "dtype"), ({"max_model_len": 1}, "max_model_len"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"), ({"kv_cache_gib": 0}, "kv_cache_gib"),
    ({"port": 70000}, "port"), ({"startup_timeout": 0}, "startup_timeout"), ({"request_timeout": -1}, "request_timeout"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"urls": ["http://a:1"], "port": 8000}, "launched server"),
    ({"weight_update": "wait"}, "weight_update"), ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"heartbeat_seconds": 0}, "heartbeat_seconds"), ({"heartbeat_timeout": -1}, "heartbeat_timeout"),
    ({"max_lora_rank": 1024}, "max_lora_rank"),
])
def test_bad_knobs_are_one_line(kwargs, says):
    with pytest.raises(ValueError, match=says) as e:
        VLLMServerConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_exact_dtype_as_the_in_process_engine():
    assert VLLMServerConfig().exact_dtype() == "float32"
    assert VLLMServerConfig(dtype="bfloat16").exact_dtype() == "bfloat16"
    assert VLLMServerConfig(dtype="auto").exact_dtype() is None
    assert VLLMServerConfig(server_args=["--quantization", "fp8"]).exact_dtype() is None
    assert VLLMServerConfig(server_args=["--kv-cache-dtype=fp8"]).exact_dtype() is None


def test_launch_command_has_the_flags_of_the_design(tiny_model_dir):
    cmd = server_command(tiny_model_dir, VLLMServerConfig(max_model_len=256), "127.0.0.1", 8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    line = " ".join(cmd)
    for flag in ("--dtype float32", "--max-model-len 256", "--gpu-memory-utilization 0.1", "--no-enable-chunked-prefill",
                 "--block-size 32", "--logprobs-mode processed_logprobs", "--enable-scale-out", "--port 8123",
                 "--host 127.0.0.1", f"--served-model-name {served_model_name(tiny_model_dir)}"):
        assert flag in line, flag


def test_lora_on_the_server_flags_and_refusals(tiny_model_dir):
    """max_lora_rank: the launched server takes adapters at run time (vLLM's smallest rank choice that holds
    it); model.lora.sync: adapter is refused, naming the knob, without it, above it, or in flight."""
    c = VLLMServerConfig(max_lora_rank=4)
    assert "--enable-lora --max-lora-rank 8 --max-loras 2" in " ".join(server_command(tiny_model_dir, c, "127.0.0.1", 1))
    assert server_env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" not in server_command(tiny_model_dir, VLLMServerConfig(), "127.0.0.1", 1)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(VLLMServerConfig())
    assert c.adapter_error(4) is None
    assert "max_lora_rank to model.lora.rank" in VLLMServerConfig().adapter_error(4)
    assert "above data.engine.init_args.max_lora_rank=4" in c.adapter_error(8)
    assert "weight_update: drain" in VLLMServerConfig(max_lora_rank=4, weight_update="in_flight").adapter_error(4)


def test_demo_server_config_is_the_demo_with_a_launched_server(tiny_model_dir):
    """configs/demo_server.yaml parses as lit-ess fit parses it, every knob in --print_config, and differs
    from configs/demo.yaml only in the engine and the output folders."""
    import dataclasses

    import yaml

    configs = Path(__file__).resolve().parents[1] / "configs"
    res = cli(["fit", "--config", str(configs / "demo_server.yaml"), "--model.init_args.model_path", tiny_model_dir,
               "--print_config"])
    assert res.returncode == 0, res.stderr[-3000:]
    engine = yaml.safe_load(res.stdout)["data"]["init_args"]["engine"]
    assert engine["class_path"] == "lit_ess.engines.VLLMServerConfig"
    assert set(engine["init_args"]) == {f.name for f in dataclasses.fields(VLLMServerConfig)}
    assert engine["init_args"]["urls"] is None                              # launched here
    demo, server = (yaml.safe_load((configs / f).read_text()) for f in ("demo.yaml", "demo_server.yaml"))
    assert {k: v for k, v in server["data"]["init_args"].items() if k != "engine"} == \
        {k: v for k, v in demo["data"]["init_args"].items() if k != "engine"}
    assert server["model"] == demo["model"]


class FakeVLLM(BaseHTTPRequestHandler):
    """A vLLM 0.32 server's answers to the start-up checks; `answers` (a class attribute) overrides them."""
    answers: dict = {}
    hits: list = []
    bodies: list = []            # (route, JSON body) of every request
    hang: float = 0.0            # seconds a generate request waits before its answer (a server that stopped)
    health_hang: float = 0.0     # the same for GET /health

    def log_message(self, *args):
        pass

    def _answer(self):
        route = self.path.split("?")[0]
        self.hits.append(self.path)
        sent = self.rfile.read(int(self.headers.get("content-length") or 0))
        req = json.loads(sent) if sent else {}
        self.bodies.append((route, req or None))
        if route == "/inference/v1/generate" and self.hang:
            time.sleep(self.hang)
        if route == "/health" and self.health_hang:
            time.sleep(self.health_hang)
        if route in self.answers:
            code, body = self.answers[route]
        else:
            code, body = 200, self.defaults.get(route, {})
        if route == "/inference/v1/generate" and req.get("model"):
            body = {**body, "model": req["model"]}                     # vLLM names the adapter that sampled
        n = (req.get("sampling_params") or {}).get("n", 1)
        if (route == "/inference/v1/generate" and code == 200 and isinstance(body, dict)
                and isinstance(body.get("choices"), list) and len(body["choices"]) == 1):
            body = {**body, "choices": [{**body["choices"][0], "index": i} for i in range(n)]}   # a group: n choices
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()     # str: vLLM's plain text
        self.send_response(code)
        self.send_header("content-type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


class QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass                     # a client that gave up on a hanging answer: a broken pipe, as expected


def start_fake(handler, port: int = 0) -> tuple[str, ThreadingHTTPServer]:
    httpd = QuietHTTPServer(("127.0.0.1", port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd


def stop_fake(httpd: ThreadingHTTPServer) -> None:
    """The server is gone: its port refuses connections."""
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def fake_server(tiny_model_dir):
    FakeVLLM.defaults = {
        "/version": {"version": "0.32.0"}, "/weight_info": {"weight_version": "0"},
        "/server_info": {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32",
                                                          "max_model_len": 256},
                                         "device_config": {"device": "cpu"},
                                         "scheduler_config": {"enable_chunked_prefill": False}}},
        "/v1/models": {"data": [{"id": served_model_name(tiny_model_dir)}]},
        "/inference/v1/generate": {"choices": [{"token_ids": [5], "logprobs": {"content": [{"logprob": -1.0}]},
                                                "weight_versions": [{"version": "0", "start": 0, "end": 1}]}]}}
    FakeVLLM.hits, FakeVLLM.bodies = [], []
    url, httpd = start_fake(FakeVLLM)
    yield url
    stop_fake(httpd)
    FakeVLLM.answers = {}


@pytest.fixture
def two_fakes(fake_server):
    """Two more faked servers, each with its own record of calls (`hits`) and `hang`."""
    pair = []
    for name in ("A", "B"):
        handler = type(f"Fake{name}", (FakeVLLM,), {"hits": [], "hang": 0.0})
        url, httpd = start_fake(handler)
        pair.append((url, httpd, handler))
    yield pair
    for _, httpd, _ in pair:
        stop_fake(httpd)


def until(done, seconds: float) -> bool:
    """Whether `done()` holds within `seconds` (asked every 0.1 s)."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > seconds:
            return False
        time.sleep(0.1)
    return True


def generates(handler) -> int:
    return sum(h == "/inference/v1/generate" for h in handler.hits)


def test_requests_of_a_dead_server_go_to_the_other_until_none_is_left(two_fakes, tiny_model_dir, capfd):
    """Least outstanding requests spread a call over both servers; one that refuses connections (gone)
    gets no more requests, and no weight push, while the other serves every sample; when the last one is
    gone too, the call fails in one line naming its URL and the request."""
    (url_a, httpd_a, a), (url_b, httpd_b, b) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10).build(tiny_model_dir)
    assert [len(g) for g in engine.generate([[1, 2], [3], [4], [5]], 4, SamplingConfig(seed=0))] == [4] * 4
    assert generates(a) >= 1 and generates(b) >= 1                      # both in use
    stop_fake(httpd_a)
    before = generates(b)
    assert [c.token_ids for c in engine.generate([[1, 2], [3]], 6, SamplingConfig(seed=0))[0]] == [[5]] * 6
    assert generates(b) - before >= 2                                   # a request per group
    warning = capfd.readouterr().err
    assert f"vLLM server {url_a}" in warning and "its requests go to the other 1 server(s)" in warning
    FakeVLLM.answers = {"/weight_info": (200, {"weight_version": "3"}), "/reset_prefix_cache": (200, {"success": True})}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine.load_weights(model.state_dict().items(), version=3)         # pushed to the live server only
    assert engine.version == 3 and "/collective_rpc" in b.hits and "/collective_rpc" not in a.hits
    stop_fake(httpd_b)
    with pytest.raises(ServerError, match=rf"vLLM server {url_b}: POST /inference/v1/generate \(prompt 0, 2 "
                                          r"sample\(s\), 2 prompt tokens\) failed: .*no other server is left") as e:
        engine.generate([[1, 2]], 2, SamplingConfig(seed=0))
    assert "\n" not in str(e.value) and str(e.value).endswith(f"(2 in engine.urls; out before: {url_a})")
    engine.close()


def test_a_server_back_at_its_url_is_taken_back_only_with_the_runs_model_weights_and_label(two_fakes, tiny_model_dir,
                                                                                         capfd):
    """A server out of the run that answers GET /health again at its URL: serving another model it stays out, with
    one warning naming why (said once, though tried at every heartbeat); serving the run's model it is taken back
    while the run goes on, after the run's last weights are reloaded there and its label is the run's step, and
    takes requests again."""
    (url_a, httpd_a, _), (url_b, _, _) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10, heartbeat_seconds=0.2,
                              heartbeat_timeout=1).build(tiny_model_dir)
    FakeVLLM.answers = {"/weight_info": (200, {"weight_version": "3"}), "/reset_prefix_cache": (200, {"success": True})}
    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items(), version=3)
    port = int(url_a.rsplit(":", 1)[1])
    stop_fake(httpd_a)
    engine.generate([[1, 2], [3]], 2, SamplingConfig(seed=0))
    assert list(engine.pool.gone) == [url_a]
    other = type("Other", (FakeVLLM,), {"hits": [], "defaults": {**FakeVLLM.defaults,
                                                                 "/v1/models": {"data": [{"id": "another-model"}]}}})
    _, httpd_a = start_fake(other, port)
    assert until(lambda: other.hits.count("/version") >= 3, 10)         # tried again at later heartbeats
    engine.generate([[1, 2], [3]], 2, SamplingConfig(seed=0))
    assert list(engine.pool.gone) == [url_a] and generates(other) == 0        # refused before any request
    err = capfd.readouterr().err
    assert err.count(f"vLLM server {url_a} answers again but stays out of the run: vLLM server {url_a} serves "
                     f"['another-model']") == 1, err
    stop_fake(httpd_a)
    back = type("Back", (FakeVLLM,), {"hits": []})
    _, httpd_a = start_fake(back, port)
    assert until(lambda: not engine.pool.gone, 10), engine.pool.gone
    engine.generate([[1, 2], [3], [4], [5]], 2, SamplingConfig(seed=0))
    assert "/collective_rpc" in back.hits and generates(back) >= 2   # checks' probe + samples
    assert back.hits.index("/collective_rpc") < back.hits.index("/weight_info", back.hits.index("/collective_rpc"))
    assert f"vLLM server {url_a} is back: it holds the weights of step 3 again" in capfd.readouterr().err
    engine.close()
    stop_fake(httpd_a)


def test_a_launched_server_whose_process_exited_is_never_taken_back(two_fakes, tiny_model_dir, capfd):
    """The server this run launched exits and another process (another run's server, the same model) takes its port
    and answers GET /health: it stays out, with one warning, and is never pushed this run's weights."""
    (url_a, httpd_a, a), (url_b, _, _) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10, heartbeat_seconds=0.2,
                              heartbeat_timeout=1).build(tiny_model_dir)
    engine.server = LaunchedServer([sys.executable, "-c", "pass"], dict(os.environ), None, url_a)   # ours, exited
    engine.server.proc.wait(30)
    port = int(url_a.rsplit(":", 1)[1])
    stop_fake(httpd_a)
    engine.generate([[1, 2], [3]], 2, SamplingConfig(seed=0))
    assert list(engine.pool.gone) == [url_a]
    other = type("OtherRun", (FakeVLLM,), {"hits": []})          # the run's model, answering at the port
    _, httpd_a = start_fake(other, port)
    assert until(lambda: other.hits.count("/health") >= 3, 10)
    engine.generate([[1, 2], [3]], 2, SamplingConfig(seed=0))
    assert list(engine.pool.gone) == [url_a] and "/collective_rpc" not in other.hits and generates(other) == 0
    err = capfd.readouterr().err
    assert err.count(f"vLLM server {url_a} answers again but stays out of the run: ") == 1, err
    assert "the server this run launched there exited (code 0)" in err, err
    before = other.hits.count("/health")          # refused again and again: probed ever more rarely (0.2 s doubling),
    time.sleep(3)                                 # not at every 0.2 s heartbeat (15 in 3 s) holding the fleet lock
    assert other.hits.count("/health") - before <= 4, other.hits.count("/health") - before
    engine.server = None                        # its process is gone: nothing for close() to stop
    engine.close()
    stop_fake(httpd_a)


@pytest.mark.parametrize("fault", ["no answer", "HTTP 500"])
def test_a_server_that_stops_answering_is_left_for_the_other(fault, two_fakes, tiny_model_dir, capfd):
    """A server that accepts requests but answers none within request_timeout (stopped, swapped out),
    or answers 500: each of its requests goes to the other server, no call waits longer than the timeout."""
    (url_a, _, a), (url_b, _, b) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10, request_timeout=2).build(tiny_model_dir)
    if fault == "no answer":
        a.hang = 30.0
    else:
        a.answers = {"/inference/v1/generate": (500, {"error": "EngineDeadError"})}
    t0 = time.perf_counter()
    groups = engine.generate([[1, 2], [3]], 3, SamplingConfig(seed=0))
    assert time.perf_counter() - t0 < 15
    assert [len(g) for g in groups] == [3, 3] and generates(b) >= 2
    said = "got no answer in 2 s (engine.request_timeout)" if fault == "no answer" else "answered HTTP 500"
    assert said in capfd.readouterr().err
    engine.close()


@pytest.mark.parametrize("heartbeat", [0.2, None], ids=["heartbeat", "none"])
def test_a_silent_server_is_found_by_the_heartbeat_long_before_request_timeout(heartbeat, two_fakes, tiny_model_dir,
                                                                               capfd):
    """A server that stops answering anything (stopped, cut off) while it holds requests: the heartbeat's
    GET /health goes unanswered twice, and its requests go to the other server then, not after
    request_timeout (without the heartbeat they wait that long)."""
    (url_a, _, a), (url_b, _, b) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10, request_timeout=8, heartbeat_seconds=heartbeat,
                              heartbeat_timeout=1).build(tiny_model_dir)
    a.hang = a.health_hang = 30.0
    t0 = time.perf_counter()
    groups = engine.generate([[1, 2], [3]], 3, SamplingConfig(seed=0))
    took = time.perf_counter() - t0
    assert [len(g) for g in groups] == [3, 3] and generates(b) >= 2
    err = capfd.readouterr().err
    if heartbeat:
        assert took < 6, took
        assert re.search(r"GET /health \(heartbeat\) failed twice in a row with \d request\(s\) in flight "
                         r"\(engine.heartbeat_timeout 1 s\): GET /health \(heartbeat\) got no answer in 1 s "
                         r"\(engine.heartbeat_timeout\); its requests go to the other 1 server", err), err
        assert url_a not in engine.pool.live()
    else:
        assert took >= 8 and "got no answer in 8 s (engine.request_timeout)" in err
    engine.close()


def test_a_slow_server_that_answers_its_heartbeat_is_kept(two_fakes, tiny_model_dir, capfd):
    """Generation slower than several heartbeats on a server whose /health answers: it keeps its requests."""
    (url_a, _, a), (url_b, _, b) = two_fakes
    engine = VLLMServerConfig(urls=[url_a, url_b], startup_timeout=10, heartbeat_seconds=0.2,
                              heartbeat_timeout=1).build(tiny_model_dir)
    a.hang = 2.0
    engine.generate([[1, 2], [3]], 3, SamplingConfig(seed=0))
    assert generates(a) >= 1 and engine.pool.live() == [url_a, url_b]
    assert "heartbeat" not in capfd.readouterr().err
    engine.close()


@pytest.mark.parametrize("health", ["no answer", "HTTP 503"])
def test_the_only_server_gone_silent_stops_the_call_in_one_line(health, fake_server, tiny_model_dir):
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10, request_timeout=60, heartbeat_seconds=0.2,
                              heartbeat_timeout=1).build(tiny_model_dir)
    FakeVLLM.hang = 30.0
    if health == "no answer":
        FakeVLLM.health_hang = 30.0
    else:
        FakeVLLM.answers = {"/health": (503, {"error": "engine dead"})}
    t0 = time.perf_counter()
    try:
        with pytest.raises(ServerGone, match="GET /health \\(heartbeat\\) failed twice") as e:
            engine.generate([[1, 2]], 2, SamplingConfig(seed=0))
        assert time.perf_counter() - t0 < 6 and "\n" not in str(e.value) and fake_server in str(e.value)
        assert ("HTTP 503" if health == "HTTP 503" else "got no answer in 1 s") in str(e.value)
    finally:
        FakeVLLM.hang = FakeVLLM.health_hang = 0.0
        engine.close()


def test_a_server_that_passes_the_checks_is_used(fake_server, tiny_model_dir):
    orphan = tempfile.mkdtemp(prefix=f"{WEIGHTS_PREFIX}{2**22 + 12345}-", dir=adapter_root())   # no such process
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    assert not os.path.exists(orphan)                        # weights left by a run killed with kill -9
    groups = engine.generate([[1, 2]], 2, SamplingConfig(seed=0))
    assert [[(c.token_ids, c.logprobs, c.version) for c in g] for g in groups] == [[([5], [-1.0], 0)] * 2]
    engine.close()
    assert not os.path.exists(engine.weights_root)


def test_a_group_is_one_request_with_n_samples_and_its_group_seed(fake_server, tiny_model_dir):
    """A call asks for each prompt's n samples in one POST /inference/v1/generate (`n`), seeded with the
    group's seed (vLLM seeds sample j with it + j): 3 prompts x 4 samples are 3 requests, not 12."""
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    FakeVLLM.bodies.clear()
    groups = engine.generate([[1, 2], [3], [1, 2]], 4, SamplingConfig(seed=9), call_seed=7, prompt_keys=[5, 6, 7])
    engine.close()
    assert [len(g) for g in groups] == [4, 4, 4]
    sent = sorted((b["token_ids"], b["sampling_params"]["n"], b["sampling_params"]["seed"])
                  for route, b in FakeVLLM.bodies if route == "/inference/v1/generate")
    assert sent == sorted([([1, 2], 4, group_seed(9, 7, 5)), ([3], 4, group_seed(9, 7, 6)),
                           ([1, 2], 4, group_seed(9, 7, 7))])


# ---- servers shared by several ranks: rank 0 pushes, the others follow ----

def test_a_follower_pushes_nothing_and_waits_for_the_step_rank_0_pushes(fake_server, tiny_model_dir):
    """A rank > 0 sharing the servers (FollowerConfig): loading step 3 writes nothing and calls no dev route;
    it returns once the server's label is 3 or newer, and leaves the label alone at start. It consumes the
    tensors it is handed (sync mode hands it the policy's iterator: under FSDP2 every rank gathers)."""
    FakeVLLM.defaults["/weight_info"] = {"weight_version": "default"}
    engine = FollowerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    assert "/update_weight_version" not in [h.split("?")[0] for h in FakeVLLM.hits]      # rank 0 labels it
    FakeVLLM.answers = {"/weight_info": (200, {"weight_version": "2"})}
    threading.Timer(0.5, lambda: FakeVLLM.answers.update({"/weight_info": (200, {"weight_version": "4"})})).start()
    t0, n = time.perf_counter(), len(FakeVLLM.hits)
    tensors = iter({"w": torch.zeros(2), "v": torch.ones(1)}.items())
    engine.load_weights(tensors, version=3)
    assert time.perf_counter() - t0 >= 0.5 and engine.version == 3
    assert next(tensors, None) is None
    assert {h.split("?")[0] for h in FakeVLLM.hits[n:]} == {"/weight_info"}
    assert os.listdir(engine.weights_root) == []
    engine.close()


def test_rank_0_of_shared_servers_labels_them_no_step_at_start(fake_server, tiny_model_dir):
    """A server by URL keeps the label of an earlier run (say step 5): rank 0 relabels it "-1" at start, so a
    follower resuming at step 3 waits for rank 0's push instead of sampling the old run's weights."""
    FakeVLLM.defaults["/weight_info"] = {"weight_version": "5"}
    engine = LeaderConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    assert ("/update_weight_version", {"new_version": "-1"}) in FakeVLLM.bodies
    engine.close()


def test_a_server_rank_0_put_out_is_left_by_the_follower_too(two_fakes, tiny_model_dir, capfd):
    """Rank 0 stopped pushing to server B (it put B out of the run); B stays at step 2 while A carries 3:
    control_timeout later the follower leaves B too, with a warning, instead of failing the run."""
    (a, _, fa), (b, _, fb) = two_fakes
    fa.answers = {"/weight_info": (200, {"weight_version": "3"})}
    fb.answers = {"/weight_info": (200, {"weight_version": "2"})}
    engine = FollowerConfig(urls=[a, b], startup_timeout=10, control_timeout=1).build(tiny_model_dir)
    t0 = time.perf_counter()
    engine.load_weights((), version=3)
    assert 1.0 <= time.perf_counter() - t0 < 10 and engine.pool.live() == [a]
    assert f"vLLM server {b} still carries weights '2' 1 s after another server took those of step 3" in \
        capfd.readouterr().err
    engine.close()


def test_worker_devices_of_a_launched_server_need_async():
    with pytest.raises(ValueError, match="worker_devices places the launched server beside the async worker process: "
                                         "set data.schedule.mode: async"):
        VLLMServerConfig(worker_devices=[1]).weight_transfer(in_process=True)


def test_a_follower_whose_step_never_comes_stops_in_one_line(fake_server, tiny_model_dir):
    FakeVLLM.answers = {"/weight_info": (200, {"weight_version": "2"})}
    engine = FollowerConfig(urls=[fake_server], startup_timeout=10, control_timeout=0.1, request_timeout=0.5,
                            server_log="/tmp/rank0-server.log").build(tiny_model_dir)
    with pytest.raises(ServerError) as e:
        engine.load_weights((), version=3)
    assert "\n" not in str(e.value) and fake_server in str(e.value)
    assert "still carries weights '2', not those of step 3, 1 s after" in str(e.value) and "rank 0 pushes" in str(e.value)
    assert "(launched by rank 0; server log: /tmp/rank0-server.log)" in str(e.value)
    engine.close()


def test_a_follower_waits_for_the_server_rank_0_is_launching(tiny_model_dir, fake_server):
    """The dedicated placement's server starts in rank 0's worker while the other ranks' engines start:
    a follower waits for its port to answer (up to startup_timeout), where a server by URL fails at once."""
    port = free_port()
    later = {}
    threading.Timer(2.0, lambda: later.update(fake=_fake_on(port))).start()
    t0 = time.perf_counter()
    engine = FollowerConfig(urls=[f"http://127.0.0.1:{port}"], startup_timeout=20).build(tiny_model_dir)
    assert 2.0 <= time.perf_counter() - t0 < 15
    engine.close()
    stop_fake(later["fake"])
    with pytest.raises(ServerGone, match=r"did not answer GET /health within 2 s \(2 x engine.startup_timeout\)"):
        FollowerConfig(urls=[f"http://127.0.0.1:{free_port()}"], startup_timeout=1).build(tiny_model_dir)


def _fake_on(port: int, handler=FakeVLLM) -> ThreadingHTTPServer:
    httpd = QuietHTTPServer(("127.0.0.1", port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("mode, placement, urls, world, roles", [
    ("async", "dedicated", None, 2, ["launches", "follows"]),
    ("async", "dedicated", ["http://h:1"], 2, ["pushes", "follows"]),
    ("sync", "colocated", ["http://h:1"], 2, ["pushes", "follows"]),
    ("async", "colocated", None, 2, ["launches", "launches"]),          # each rank its own server
    ("async", "dedicated", ["http://h:1"], 1, ["pushes"]),
])
def test_servers_shared_by_the_ranks_take_weights_from_rank_0_alone(mode, placement, urls, world, roles):
    from test_async_ranks import ThreadRanks

    from lit_ess.rollout.placement import Placement, engine_for_rank

    shared, got = {"slots": [None] * world, "barrier": threading.Barrier(world)}, [None] * world

    def rank(r):
        got[r] = engine_for_rank(VLLMServerConfig(urls=urls), Placement.of(mode, placement, world), ThreadRanks(r, world, shared))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    said = ["follows" if isinstance(c, FollowerConfig) else "pushes" if c.urls else "launches" for c in got]
    assert all(isinstance(c, LeaderConfig) for c in got[:1]) == ("follows" in roles)      # rank 0 leads shared servers
    assert said == roles
    if roles == ["launches", "follows"]:           # the follower names the port rank 0 launches on, and its log
        assert got[0].port is not None and got[1].urls == [f"http://127.0.0.1:{got[0].port}"]
        assert got[0].log_file and got[1].server_log == got[0].log_file and got[1].log_file is None
    elif "follows" in roles:
        assert got[1].urls == urls and got[1].port is None


def test_a_refused_prefix_cache_reset_fails_the_update_and_still_resumes(fake_server, tiny_model_dir):
    """/reset_prefix_cache answers 200 with success false while requests run: the update must not
    pass as done (stale KV would be reused), and the server must not stay paused."""
    FakeVLLM.answers = {"/reset_prefix_cache": (200, {"success": False}), "/weight_info": (200, {"weight_version": "0"})}
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ServerError, match=r"POST /reset_prefix_cache answered \{'success': False\}") as e:
        engine.load_weights(model.state_dict().items(), version=3)
    assert "\n" not in str(e.value) and fake_server in str(e.value)
    calls = [h.split("?")[0] for h in FakeVLLM.hits]
    assert calls[-5:] == ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert engine.version == 0 and os.listdir(engine.weights_root) == []     # the refused folder is not kept
    engine.close()


@pytest.mark.parametrize("mode, pause, reset", [("drain", "mode=wait", ""),
                                               ("in_flight", "mode=keep", "reset_running_requests=true")])
def test_an_update_pauses_as_weight_update_says(mode, pause, reset, fake_server, tiny_model_dir):
    """drain: running requests finish first; in_flight: they are frozen, and the prefix-cache reset
    preempts them (their prefix is recomputed with the new weights when they resume)."""
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10, weight_update=mode).build(tiny_model_dir)
    FakeVLLM.answers = {"/reset_prefix_cache": (200, {"success": True}), "/weight_info": (200, {"weight_version": "3"})}
    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items(), version=3)
    calls = FakeVLLM.hits[-6:]
    assert [h.split("?")[0] for h in calls] == ["/pause", "/collective_rpc", "/update_weight_version",
                                                "/reset_prefix_cache", "/resume", "/weight_info"]
    assert calls[0] == f"/pause?{pause}" and calls[3] == "/reset_prefix_cache" + (f"?{reset}" if reset else "")
    engine.close()


@pytest.mark.parametrize("route, answer, says", [
    ("/inference/v1/generate", (403, {"error": {"message": "disabled"}}), "--enable-scale-out"),
    ("/server_info", (404, {"detail": "Not Found"}), "VLLM_SERVER_DEV_MODE=1"),
    ("/version", (200, {"version": "0.31.2"}), "runs vLLM 0.31.2"),
    ("/v1/models", (200, {"data": [{"id": "other@0123456789ab"}]}), "--served-model-name"),
    ("/v1/models", (200, {"data": [{"id": "/no/such/folder"}]}), "--served-model-name"),
])
def test_unusable_servers_are_refused_with_the_flag_to_add(route, answer, says, fake_server, tiny_model_dir):
    """The answers of a server started without --enable-scale-out (403 on the token route), without
    VLLM_SERVER_DEV_MODE=1 (404 on dev routes), of another vLLM or serving another model (faked: a real
    server per case would cost minutes of start-up)."""
    FakeVLLM.answers = {route: answer}
    with pytest.raises(ServerError, match=says) as e:
        VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir)
    assert "\n" not in str(e.value) and fake_server in str(e.value)


@pytest.mark.parametrize("key, value, says", [
    ("logprobs_mode", "raw_logprobs", "--logprobs-mode processed_logprobs"), ("dtype", "torch.bfloat16", "--dtype float32"),
    ("max_model_len", 128, "--max-model-len 256")])
def test_server_settings_are_checked(key, value, says, fake_server, tiny_model_dir):
    FakeVLLM.defaults["/server_info"]["vllm_config"]["model_config"][key] = value
    with pytest.raises(ServerError, match=says):
        VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_model_len=256).build(tiny_model_dir)


@pytest.mark.parametrize("lora_config, unload, says", [
    (None, None, "--enable-lora --max-lora-rank 8"),
    ({"max_lora_rank": 1}, None, "--enable-lora --max-lora-rank 8"),
    ({"max_lora_rank": 8}, (404, {"detail": "Not Found"}), "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
])
def test_a_server_without_runtime_lora_is_refused_with_the_flag_to_add(lora_config, unload, says, fake_server,
                                                                         tiny_model_dir):
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = lora_config
    FakeVLLM.answers = {"/v1/unload_lora_adapter": unload or (404, {"error": {"message": "not found", "code": 404}})}
    with pytest.raises(ServerError, match=says) as e:
        VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=4).build(tiny_model_dir)
    assert "\n" not in str(e.value) and fake_server in str(e.value)


def test_adapters_on_a_server_holding_another_runs_weights_are_refused(fake_server, tiny_model_dir):
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = {"max_lora_rank": 8}
    FakeVLLM.answers = {"/v1/unload_lora_adapter": (404, {"error": {"message": "not found", "code": 404}}),
                        "/weight_info": (200, {"weight_version": "57"})}
    with pytest.raises(ServerError, match="holds weights pushed by another run .*restart it"):
        VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=4).build(tiny_model_dir)
    VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir).close()     # full weights: fine


def test_a_server_with_runtime_lora_is_accepted(fake_server, tiny_model_dir):
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = {"max_lora_rank": 8}
    FakeVLLM.answers = {"/v1/unload_lora_adapter": (404, {"error": {"message": "not found", "code": 404}})}
    VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=8).build(tiny_model_dir).close()
    assert "/v1/unload_lora_adapter" in FakeVLLM.hits


def fake_adapter(scale: float) -> list[tuple[str, torch.Tensor]]:
    """An adapter payload as lit_ess.lora.adapter_weights names it (rank 4 on one q_proj)."""
    owner = "base_model.model.model.layers.0.self_attn.q_proj"
    return [(f"{owner}.lora_A.weight", torch.full((4, 8), scale)), (f"{owner}.lora_B.weight", torch.full((8, 4), scale))]


def test_each_adapter_push_is_loaded_named_by_the_next_requests_and_unloaded_in_turn(fake_server, tiny_model_dir):
    """Adapters through a server by URL whose load and unload routes answer plain text, as vLLM's do: each push
    is loaded from its own folder, the next requests name it and their tokens carry its version, the third
    push unloads the first, and close unloads the rest (the server goes on)."""
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = {"max_lora_rank": 8}
    FakeVLLM.answers = {"/v1/load_lora_adapter": (200, "Success: LoRA adapter added successfully."),
                        "/v1/unload_lora_adapter": (404, {"error": {"message": "not found", "code": 404}})}
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=4).build(tiny_model_dir)
    FakeVLLM.answers["/v1/unload_lora_adapter"] = (200, "Success: LoRA adapter removed successfully.")
    names = []
    for version in (1, 2, 3):
        engine.load_weights(iter(fake_adapter(float(version))), version)
        body = [b for r, b in FakeVLLM.bodies if r == "/v1/load_lora_adapter"][-1]
        assert os.path.isfile(Path(body["lora_path"]) / "adapter_config.json")
        names.append(body["lora_name"])
        [[c]] = engine.generate([[1, 2, 3]], 1, SamplingConfig(max_new_tokens=1, seed=0))
        assert FakeVLLM.bodies[-1][1]["model"] == body["lora_name"] and c.token_versions == [version] and c.version == version
    unloads = [b["lora_name"] for r, b in FakeVLLM.bodies if r == "/v1/unload_lora_adapter"]
    assert unloads[-1:] == names[:1] and len(set(names)) == 3
    folders = [b["lora_path"] for r, b in FakeVLLM.bodies if r == "/v1/load_lora_adapter"]
    assert not os.path.exists(folders[0]) and all(os.path.isdir(f) for f in folders[1:])
    engine.close()
    unloads = [b["lora_name"] for r, b in FakeVLLM.bodies if r == "/v1/unload_lora_adapter"]
    assert unloads[-2:] == names[1:] and not any(os.path.exists(f) for f in folders)


def test_an_adapter_the_server_cannot_load_fails_the_push_not_the_server(fake_server, tiny_model_dir):
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = {"max_lora_rank": 8}
    FakeVLLM.answers = {"/v1/load_lora_adapter": (500, {"error": {"message": "unsupported module", "code": 500}}),
                        "/v1/unload_lora_adapter": (404, {"error": {"message": "not found", "code": 404}})}
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=4).build(tiny_model_dir)
    with pytest.raises(ServerError, match="unsupported module") as e:
        engine.load_weights(iter(fake_adapter(1.0)), 1)
    assert "ServerGone" not in type(e.value).__name__ and engine.pool.live() == [fake_server]
    engine.close()


def test_an_adapter_answer_from_other_weights_is_refused(fake_server, tiny_model_dir):
    """A request that came back sampled by the base weights of another version (a client pushing full weights
    to the same server) is refused, not recorded as the adapter's."""
    FakeVLLM.defaults["/server_info"]["vllm_config"]["lora_config"] = {"max_lora_rank": 8}
    FakeVLLM.answers = {"/v1/load_lora_adapter": (200, "Success"),
                        "/v1/unload_lora_adapter": (404, {"error": {"message": "not found", "code": 404}})}
    engine = VLLMServerConfig(urls=[fake_server], startup_timeout=10, max_lora_rank=4).build(tiny_model_dir)
    engine.load_weights(iter(fake_adapter(1.0)), 1)
    FakeVLLM.defaults["/inference/v1/generate"]["choices"][0]["weight_versions"] = [{"version": "7", "start": 0, "end": 1}]
    with pytest.raises(ServerError, match="another client changes this server"):
        engine.generate([[1, 2, 3]], 1, SamplingConfig(max_new_tokens=1, seed=0))
    engine.close()


def test_a_server_by_hand_on_the_same_folder_is_accepted(fake_server, tiny_model_dir):
    """`vllm ... --model DIR` without lit-ess's name: the folder is readable here and fingerprints alike."""
    FakeVLLM.answers = {"/v1/models": (200, {"data": [{"id": tiny_model_dir}]})}
    VLLMServerConfig(urls=[fake_server], startup_timeout=10).build(tiny_model_dir).close()


def test_a_dead_url_fails_in_one_line(tiny_model_dir):
    with pytest.raises(ServerError, match=r"http://127.0.0.1:9: GET /version failed") as e:
        VLLMServerConfig(urls=["http://127.0.0.1:9"], startup_timeout=5).build(tiny_model_dir)
    assert "\n" not in str(e.value)


def test_the_launched_server_dies_with_its_parent(tmp_path):
    """A parent killed with kill -9 takes its server with it (PR_SET_PDEATHSIG), shown with a stand-in
    for vLLM: a sleeping process launched as the engine launches the server."""
    code = ("import sys, time; from lit_ess.engines.server_launch import LaunchedServer; "
            "s = LaunchedServer([sys.executable, '-c', 'import time; time.sleep(600)'], {}, sys.argv[1], 'http://x'); "
            "print(s.proc.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "log")], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    child = int(parent.stdout.readline())
    os.kill(child, 0)                                       # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the server outlived the process that launched it")


def test_serve_names_a_missing_model_folder(tmp_path):
    res = subprocess.run([sys.executable, "-m", "lit_ess.engines.serve", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--model" in res.stderr and "config.json" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.e2e
def test_serve_reports_a_server_that_fails_to_start_with_its_log(tiny_model_dir, tmp_path):
    """The documented command with a flag vLLM refuses: the server exits during start-up, and `serve`
    says so in one line that names its log file, where vLLM's own message is."""
    log = tmp_path / "server.log"
    res = subprocess.run([sys.executable, "-m", "lit_ess.engines.serve", "--model", tiny_model_dir, "--port",
                          str(free_port()), "--log-file", str(log), "--no-such-vllm-flag"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "exited with code" in last and f"(log: {log})" in last
    assert "--no-such-vllm-flag" in log.read_text()


TOKEN_ENV = "LIT_ESS_SERVER_TOKEN"
TOKEN = secrets.token_hex(16)           # the module server's shared secret: it listens on every interface


def test_a_server_on_a_non_loopback_host_needs_a_shared_token(tiny_model_dir, tmp_path, monkeypatch):
    """`serve --host 0.0.0.0` (reachable from other machines) without LIT_ESS_SERVER_TOKEN, or with a short one,
    and a launched server given `--host 0.0.0.0` in server_args: refused in one line naming the variable,
    before any vLLM starts (main: such a server started, its weight routes open to anyone on the network)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    serve = [sys.executable, "-m", "lit_ess.engines.serve", "--model", tiny_model_dir, "--host", "0.0.0.0", "--port",
             str(free_port()), "--log-file", str(tmp_path / "server.log")]
    for token, says in ((None, r"--host 0\.0\.0\.0 lets other machines reach the server's weight routes: set "
                               r"LIT_ESS_SERVER_TOKEN to a shared secret of 16 characters or more"),
                        ("short", r"LIT_ESS_SERVER_TOKEN is 5 characters: a shared secret needs 16 or more")):
        env = dict(os.environ, **({TOKEN_ENV: token} if token else {}))
        res = subprocess.run(serve, capture_output=True, text=True, timeout=60, env=env)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert re.fullmatch(rf"python -m lit_ess\.engines\.serve: error: {says}.*", res.stderr.strip()), res.stderr
    assert not (tmp_path / "server.log").exists()
    with pytest.raises(ValueError, match=r"^engine\.server_args --host 0\.0\.0\.0 lets other machines reach the "
                                         r"server's weight routes: set LIT_ESS_SERVER_TOKEN"):
        VLLMServerConfig(server_args=["--host=0.0.0.0"], startup_timeout=60).build(tiny_model_dir)


# ---- one real server for the module, started by the documented command ----

@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """`python -m lit_ess.engines.serve --model DIR --host 0.0.0.0 --port P --max-model-len 256 --max-lora-rank 8`
    with LIT_ESS_SERVER_TOKEN set, as a fleet's server: its URL on this machine once it prints that it is ready;
    SIGTERM stops it (and its vLLM) at the end of the module. The token stays in the environment meanwhile, so
    every client of the module (engines, `lit-ess fit` runs, the helpers here) sends it. (With LoRA on: requests
    that name no adapter sample from the base weights, which every other test checks to 1e-5.)"""
    port, log = free_port(), tmp_path_factory.mktemp("served") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TOKEN_ENV, TOKEN)
        proc = subprocess.Popen([sys.executable, "-m", "lit_ess.engines.serve", "--model", tiny_model_dir, "--host",
                                 "0.0.0.0", "--port", str(port), "--max-model-len", "256", "--max-lora-rank", "8",
                                 "--startup-timeout", "300", "--log-file", str(log)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.perf_counter()
        while "ready in" not in (line := proc.stdout.readline()):
            if not line:                                             # serve exited (or timed out) during start-up
                pytest.fail(f"serve did not start: {proc.stderr.read()[-2000:]}")
        print(f"{line.strip()} ({time.perf_counter() - t0:.0f} s)")
        url = f"http://127.0.0.1:{port}"
        assert f":{port}" in line
        SERVED_LOG[url] = log
        yield url
        proc.terminate()
        assert proc.wait(60) == 0


SERVED_LOG: dict[str, Path] = {}        # the module server's URL -> its log (uvicorn logs every call)


def reloads(url: str) -> int:
    """Weight reloads the module server has logged so far."""
    return SERVED_LOG[url].read_text().count("POST /collective_rpc")


@pytest.fixture(scope="module")
def server(served, tiny_model_dir):
    engine = VLLMServerConfig(urls=[served], max_model_len=256).build(tiny_model_dir)
    yield engine
    engine.close()


def http(url: str, route: str, method: str = "GET", body: dict | None = None,
         authorization: str | None = "token") -> tuple[int, str]:
    """One call to a server: its status and text. `authorization`: the header sent ("token": the
    environment's LIT_ESS_SERVER_TOKEN as a bearer token; None: no header)."""
    import urllib.error

    if authorization == "token":
        authorization = f"Bearer {os.environ[TOKEN_ENV]}" if os.environ.get(TOKEN_ENV) else None
    req = urllib.request.Request(url + route, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json",
                                          **({"authorization": authorization} if authorization else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def weight_label(url: str) -> str:
    status, text = http(url, "/weight_info")
    assert status == 200, (status, text)
    return json.loads(text)["weight_version"]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.mark.e2e
@pytest.mark.parametrize("s", [SamplingConfig(temperature=t, max_new_tokens=16, seed=2) for t in (0.7, 1.0)] +
                         [SamplingConfig(temperature=1.2, top_k=7, top_p=0.85, max_new_tokens=16, seed=11)],
                         ids=["T0.7", "T1.0", "topk-topp"])
def test_logprobs_equal_the_trainers(server, hf_model, s):
    groups = server.generate(PROMPTS, 4, s)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert max_logprob_gap(hf_model, PROMPTS, groups, s) < 1e-5
    assert all(c.version == 0 and len(c.token_ids) == len(c.logprobs) > 0 for g in groups for c in g)


@pytest.mark.e2e
def test_samples_of_a_group_are_not_copies(server):
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=1234)
    groups = server.generate(PROMPTS, 8, s, call_seed=3)
    for g in groups:
        assert len({tuple(c.token_ids) for c in g}) == 8
    assert [c.token_ids for c in groups[0]] != [c.token_ids for c in groups[2]]        # equal prompts differ
    assert [c.token_ids for c in server.generate(PROMPTS, 8, s, call_seed=3)[0]] == [c.token_ids for c in groups[0]]
    assert [c.token_ids for c in server.generate(PROMPTS, 8, s, call_seed=4)[0]] != [c.token_ids for c in groups[0]]


@pytest.mark.e2e
def test_the_server_and_the_in_process_engine_draw_the_same_tokens(server, vllm_engine):
    """Both vLLM engines seed a group alike (group_seed, sample j: + j): the same prompts, seed and call
    seed give the same token ids and logprobs from the server as in process."""
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=99)
    here = vllm_engine.generate(PROMPTS, 8, s, call_seed=2, prompt_keys=[3, 4, 5])
    there = server.generate(PROMPTS, 8, s, call_seed=2, prompt_keys=[3, 4, 5])
    assert [[c.token_ids for c in g] for g in there] == [[c.token_ids for c in g] for g in here]
    assert [x for g in there for c in g for x in c.logprobs] == \
        pytest.approx([x for g in here for c in g for x in c.logprobs], abs=1e-5)


@pytest.mark.e2e
def test_stop_strings_and_eos_end_completions(server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    s = SamplingConfig(temperature=1.0, max_new_tokens=24, stop=["a", "b", "c", "1"], seed=5)
    reasons = set()
    for g in server.generate(PROMPTS, 6, s):
        for c in g:
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            reasons.add(c.finish_reason)
            if c.finish_reason == "stop" and c.token_ids[-1] != tok.eos_token_id:
                assert any(x in text for x in s.stop)
            else:
                assert not any(x in text for x in s.stop), (c, text)
                assert c.finish_reason == "stop" or len(c.token_ids) == s.max_new_tokens
    assert "stop" in reasons


def perturbed(model_dir: str, seed: int):
    """The model of `model_dir` with Gaussian noise (std 0.05, `seed`) on every weight: other weights to push."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.e2e
def test_a_weight_update_changes_logprobs_and_version(server, tiny_model_dir):
    model = perturbed(tiny_model_dir, seed=0)
    s = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=3)
    before = max_logprob_gap(model, PROMPTS, server.generate(PROMPTS, 2, s), s)
    t0 = time.perf_counter()
    server.load_weights(model.state_dict().items(), version=7)          # tied lm_head / embeddings included
    print(f"weight update {time.perf_counter() - t0:.2f} s")
    groups = server.generate(PROMPTS, 2, s)
    assert before > 1e-3
    assert max_logprob_gap(model, PROMPTS, groups, s) < 1e-5
    assert server.version == 7 and all(c.version == 7 for g in groups for c in g)
    assert weight_label(server.urls[0]) == "7"
    assert len(os.listdir(server.weights_root)) == 1                     # the previous folder is gone


@pytest.mark.e2e
def test_sync_fit_through_the_server_is_on_policy(served, tiny_model_dir, tmp_path):
    """`lit-ess fit` with the server engine by URL, a server started by the documented command: every
    step's ESS is 1, the lag-0 alarm applies (fp32 on both sides) and stays silent."""
    cfg = rl_config(tiny_model_dir, tmp_path, max_steps=3, extra_data={
        "engine": {"class_path": "lit_ess.engines.VLLMServerConfig", "init_args": {"urls": [served]}}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess = [v for _, v in s["train/ess"]]
    assert len(ess) == 3 and min(ess) >= 0.9999, ess
    assert [v for _, v in s["train/ess_alarms"]] == [0.0] * 3 and "ess_alarm" not in res.stderr
    assert min(v for _, v in s["train/grad_norm"]) > 0                    # the weights moved between steps
    assert weight_label(served) == "2"                                    # pushed before step 2


@pytest.mark.e2e
def test_adapter_sync_through_the_server_is_on_policy(served, tiny_model_dir, tmp_path):
    """model.lora.sync: adapter with the server engine: every push is loaded through /v1/load_lora_adapter and
    the next requests name it. At lr 2e-2 the adapter moves the policy a lot each step, so a server that
    sampled from anything but the newest adapter would show in the ESS; the base weights' label never moves."""
    base = VLLMServerConfig(urls=[served]).build(tiny_model_dir)     # the model's own weights, as version 0 (the
    base.load_weights(iter(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()), 0)  # module's
    base.close()                                                       # other tests push theirs to this server)
    label = weight_label(served)
    cfg = rl_config(tiny_model_dir, tmp_path, max_steps=3, lr=2e-2, extra_model={"lora": {"rank": 4, "sync": "adapter"}},
                    extra_data={"engine": {"class_path": "lit_ess.engines.VLLMServerConfig",
                                           "init_args": {"urls": [served], "max_lora_rank": 4}}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess = [v for _, v in s["train/ess"]]
    assert len(ess) == 3 and min(ess) >= 0.9999, ess
    assert min(v for _, v in s["train/grad_norm"]) > 0 and "ess_alarm" not in res.stderr
    names = [m["id"] for m in json.loads(http(served, "/v1/models")[1])["data"]]
    assert not any(n.startswith("lit-ess-") for n in names), names            # the run's adapters, unloaded at its end
    assert weight_label(served) == label


class DyingProxy:
    """A TCP relay 127.0.0.1:port -> `target` that dies on its `die_at`-th connection: it closes its port
    and every connection it relays, requests in flight included (a server killed mid-call, as the client sees it)."""

    def __init__(self, target: str, die_at: int):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.die_at, self.accepted, self.open, self.dead = die_at, 0, [], threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.die_at and self.accepted >= self.die_at:
                client.close()
                return self.kill()
            upstream = socket.create_connection(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def kill(self):
        self.dead.set()
        self.sock.close()
        for s in self.open:
            try:
                s.shutdown(socket.SHUT_RDWR)     # wakes the relay threads reading it (a close alone would not)
                s.close()
            except OSError:
                pass


@pytest.mark.e2e
def test_a_server_killed_mid_call_leaves_its_requests_to_the_other(served, server, tiny_model_dir, capfd):
    """Two URLs, one of them a relay to the real server that dies mid-call: every sample still comes
    back, equal (same seed) to what the real server alone returns, and the dead URL gets no more requests."""
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=21)
    want = server.generate(PROMPTS, 8, s, call_seed=5)
    proxy = DyingProxy(served, die_at=0)
    engine = VLLMServerConfig(urls=[proxy.url, served], max_model_len=256).build(tiny_model_dir)
    proxy.die_at = proxy.accepted + 1        # at the next call's first new connection (its 2 of 3 groups: >= 1 new)
    got = engine.generate(PROMPTS, 8, s, call_seed=5)
    assert proxy.dead.is_set()
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    for g, w in zip(got, want):
        for c, d in zip(g, w):
            assert c.logprobs == pytest.approx(d.logprobs, abs=1e-5)
    assert f"vLLM server {proxy.url}: POST /inference/v1/generate" in capfd.readouterr().err
    assert list(engine.pool.gone) == [proxy.url]
    assert len(engine.generate(PROMPTS, 2, s)[0]) == 2              # later calls: the live server only
    engine.close()


@pytest.mark.e2e
def test_a_server_killed_and_restarted_at_its_url_is_taken_back_with_the_runs_weights(
        served, server, vllm_engine, hf_model, tiny_model_dir, tmp_path, capfd):
    """Two real servers, the second launched here: kill -9 of its process group puts it out and the run goes on
    with the first; restarted at the same URL (the model folder's weights, no label), it is taken back while the run
    goes on, once it holds the run's pushed weights and carries their label, and samples what the first does."""
    c = VLLMServerConfig(max_model_len=256)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def launch(log: str) -> LaunchedServer:
        s = LaunchedServer(server_command(tiny_model_dir, c, "127.0.0.1", port), server_env(c), str(tmp_path / log), url)
        s.wait_ready(600)
        return s

    second = launch("first.log")
    engine = VLLMServerConfig(urls=[served, url], max_model_len=256, heartbeat_seconds=1.0,
                              heartbeat_timeout=2.0).build(tiny_model_dir)
    try:
        pushed = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in pushed.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load_weights(pushed.state_dict().items(), version=3)
        s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=8)
        os.killpg(second.proc.pid, signal.SIGKILL)
        second.proc.wait(30)
        assert [len(g) for g in engine.generate(PROMPTS, 4, s)] == [4, 4, 4]        # from the first alone
        assert list(engine.pool.gone) == [url]
        second = launch("restarted.log")
        assert until(lambda: not engine.pool.gone, 60), engine.pool.gone           # the heartbeat finds it, it is taken back
        groups = engine.generate(PROMPTS * 4, 4, s, call_seed=1)
        err = capfd.readouterr().err
        assert f"vLLM server {url} is back: it holds the weights of step 3 again" in err, err
        assert weight_label(url) == "3" and "POST /collective_rpc" in (tmp_path / "restarted.log").read_text()
        assert "POST /inference/v1/generate" in (tmp_path / "restarted.log").read_text()     # it samples again
        assert all(c.version == 3 for g in groups for c in g)
        alone = VLLMServerConfig(urls=[url], max_model_len=256).build(tiny_model_dir)  # the restarted one's samples
        try:
            there = alone.generate(PROMPTS, 4, s, call_seed=1)
        finally:
            alone.close()
        assert [[c.token_ids for c in g] for g in there] == [[c.token_ids for c in g] for g in groups[:3]]
        base = vllm_engine.generate(PROMPTS, 4, s, call_seed=1)                   # the model folder's weights
        assert [[c.token_ids for c in g] for g in there] != [[c.token_ids for c in g] for g in base]
    finally:
        engine.close()
        second.stop()
        server.load_weights(hf_model.state_dict().items(), version=0)           # the module's server as it was


def test_a_server_gone_in_an_async_run_stops_it_with_the_same_line(fake_server, tiny_model_dir):
    """mode: async, the engine in the worker process: a server gone after step 0 (the worker fails on the
    push of step 1, or on a phase it samples ahead) reaches the trainer as its own one line (EngineFault),
    not as the worker's traceback."""
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.engines import EngineFault

    FakeVLLM.answers = {"/reset_prefix_cache": (200, {"success": True})}
    url, httpd = start_fake(FakeVLLM)
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=VLLMServerConfig(urls=[url], startup_timeout=10),
                           schedule=Schedule(mode="async", max_staleness=1), batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2),
                           source=Arithmetic(size=40), sampling=SamplingConfig(max_new_tokens=3, seed=0),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    try:
        dm.push_weights({"w": torch.zeros(2)}.items(), 0)
        dm.next_batch(0)
        stop_fake(httpd)
        dm.push_weights({"w": torch.ones(2)}.items(), 1)
        with pytest.raises(EngineFault, match=rf"^vLLM server {url}: POST /(pause\S*|inference/v1/generate \(prompt \d+, \d+ sample\(s\), \d+ prompt tokens\)) "
                                          r"failed: ClientConnectorError") as e:
            for step in range(1, 4):
                dm.next_batch(step)
        assert "\n" not in str(e.value)
    finally:
        dm.teardown("fit")


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            out.append(int(stat.parent.name))
    return out


def vllm_children(pid: int) -> list[int]:
    """The pids of the vLLM API servers process `pid` launched."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"vllm.entrypoints.openai.api_server" in cmd:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.e2e
def test_kill_9_of_the_launched_server_stops_the_run_in_one_line_and_the_checkpoint_resumes(served, tiny_model_dir,
                                                                                           tmp_path):
    """`lit-ess fit` launches its server; kill -9 of that server after the step-2 checkpoint: the run
    exits 1 with one line naming the server's URL, its exit and the request that failed, no traceback,
    no vLLM process left. `--ckpt_path last` then resumes on a server by URL (the module's, which holds
    other weights under another label): the checkpoint's weights are pushed before its first request
    (ESS 1 on the first resumed step, the label of the checkpoint's step)."""
    cfg = rl_config(tiny_model_dir, tmp_path, max_steps=8, ckpt_every=1, extra_data={
        "engine": {"class_path": "lit_ess.engines.VLLMServerConfig",
                   "init_args": {"max_model_len": 256, "log_file": str(tmp_path / "server.log")}}})
    config = write_config(cfg, tmp_path / "config.yaml")
    env = dict(os.environ, PYTHONPATH=pythonpath(), TOKENIZERS_PARALLELISM="false")
    with open(tmp_path / "stderr", "w") as err:
        fit = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(config)], env=env,
                               stdout=subprocess.DEVNULL, stderr=err)
    ckpt = tmp_path / "ckpt"
    deadline = time.time() + 400
    while not list(ckpt.glob("*step=2*.ckpt")) and fit.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    pids = vllm_children(fit.pid)
    assert len(pids) == 1 and fit.poll() is None, (pids, (tmp_path / "stderr").read_text()[-3000:])
    os.kill(pids[0], signal.SIGKILL)
    try:
        rc = fit.wait(300)                                   # never a hang
    except subprocess.TimeoutExpired:
        fit.kill()
        pytest.fail("the run hung after its server was killed")
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 1 and "Traceback" not in stderr, stderr[-3000:]
    said = [ln for ln in stderr.splitlines() if ln.startswith("lit-ess: error:")]
    assert len(said) == 1, stderr[-3000:]
    assert re.match(r"lit-ess: error: vLLM server http://127\.0\.0\.1:\d+ \(exited with code -9\); server log: "
                    rf"{re.escape(str(tmp_path / 'server.log'))}: POST /\S+ .*(failed|no answer)", said[0]), said[0]
    deadline = time.time() + 15                              # its engine core went with it (a SIGKILLed
    while group_members(pids[0]) and time.time() < deadline:  # process may take a moment to be reaped)
        time.sleep(0.2)
    assert group_members(pids[0]) == [], group_members(pids[0])
    last = max(int(re.search(r"step=(\d+)", p.name).group(1)) for p in ckpt.glob("*step=*.ckpt"))

    cfg["data"]["init_args"]["engine"]["init_args"] = {"urls": [served], "max_model_len": 256}
    cfg["trainer"]["max_steps"] = last + 2
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                        "init_args": {"path": str(tmp_path / "resumed.jsonl")}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "resume.yaml")), "--ckpt_path", "last"])
    assert res.returncode == 0, res.stderr[-4000:]
    steps = [json.loads(ln) for ln in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [last, last + 1]
    assert set(steps[0]["versions"]) == {last}               # sampled by the checkpoint's weights, labelled so
    ess = [v for _, v in scalars(tmp_path)["train/ess"]][-2:]     # the resumed run's two steps (the last logged)
    assert min(ess) >= 0.9999, ess


@pytest.mark.e2e
@pytest.mark.dist
def test_two_ddp_ranks_sharing_one_server_train_the_one_rank_batch(served, tiny_model_dir, tmp_path):
    """2 DDP ranks name one server in `urls` (each rank's engine sends its share of the prompts; rank 0 pushes
    the weights, rank 1's engine waits until the server carries the step): losses, ESS, gradient norms and
    rollout statistics equal those of 1 process on that server, as test_dist checks for the in-process
    engine, and the ranks train different prompts."""
    from test_dist import _config, _fit, _records

    engine = {"class_path": "lit_ess.engines.VLLMServerConfig", "init_args": {"urls": [served], "max_model_len": 256}}
    runs, pushes = {}, {}
    for name, world in (("one", 1), ("ddp", 2)):
        out, before = tmp_path / name, reloads(served)
        runs[name] = _fit(_config(tiny_model_dir, out, world, "ddp", max_steps=3, extra_data={"engine": engine}), out)
        pushes[name] = reloads(served) - before
    assert pushes["ddp"] == pushes["one"] == 3, pushes          # rank 0 alone pushes; rank 1 waits for its step
    one, two = runs["one"], runs["ddp"]
    for key in ("train/loss", "train/ess", "train/grad_norm", "train/tokens", "train/kl_behavior",
                "rollout/reward_mean", "rollout/reward_std", "rollout/response_len"):
        a, b = [v for _, v in one[key]], [v for _, v in two[key]]
        assert len(a) == len(b) == 3 and a == pytest.approx(b, rel=1e-5, abs=1e-5), (key, a, b)
    assert min(v for _, v in two["train/ess"]) >= 0.9999
    r0, r1 = _records(tmp_path / "ddp" / "prompts.jsonl"), _records(tmp_path / "ddp" / "prompts.jsonl.rank1")
    for a, b, s in zip(r0, r1, _records(tmp_path / "one" / "prompts.jsonl"), strict=True):
        assert not set(a["prompt_ids"]) & set(b["prompt_ids"]), "both ranks trained the same prompt"
        assert sorted(a["prompt_ids"] + b["prompt_ids"]) == sorted(s["prompt_ids"])


@pytest.mark.e2e
@pytest.mark.dist
def test_two_ranks_async_on_the_dedicated_server_rank_0_launches(tiny_model_dir, tmp_path):
    """placement: dedicated with a launched server, 2 DDP ranks, async S = 1: rank 0 launches one server,
    both ranks' worker processes send their own shares to it, and rank 0 alone pushes the weights (each
    step reloaded once); the rows respect the bound and the ranks train different prompts."""
    from test_dist import _config, _fit, _records

    log = tmp_path / "server.log"
    engine = {"class_path": "lit_ess.engines.VLLMServerConfig",
              "init_args": {"max_model_len": 256, "log_file": str(log), "heartbeat_seconds": None}}
    data = {"engine": engine,
            "schedule": {"mode": "async", "placement": "dedicated", "max_staleness": 1, "worker_timeout": 300}}
    got = _fit(_config(tiny_model_dir, tmp_path, 2, "ddp", max_steps=4, steps_per_rollout=2, extra_data=data), tmp_path)
    assert len(got["train/loss"]) == 4 and max(v for _, v in got["train/policy_lag_max"]) <= 1
    text = log.read_text()
    versions = re.findall(r"POST /update_weight_version", text)
    reloads = re.findall(r"POST /collective_rpc", text)
    # the label set once at start, then steps 0 and 2 reloaded once each (twice each if every rank pushed)
    assert (len(reloads), len(versions)) == (2, 3), (len(reloads), len(versions))
    r0, r1 = _records(tmp_path / "prompts.jsonl"), _records(tmp_path / "prompts.jsonl.rank1")
    for a, b in zip(r0, r1, strict=True):
        assert not set(a["prompt_ids"]) & set(b["prompt_ids"]), "both ranks trained the same prompt"


@pytest.mark.e2e
def test_the_servers_routes_need_the_shared_token(served, tiny_model_dir):
    """The module's server listens on every interface with LIT_ESS_SERVER_TOKEN set: its weight routes, and every
    other route but GET /health, answer 401 to a request without the token, with another token, another scheme
    or no scheme (main: vLLM's dev routes took anyone's call: the relabel below went through)."""
    label = weight_label(served)
    calls = [("POST", "/update_weight_version", {"new_version": "999"}),
             ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": tiny_model_dir}}),
             ("POST", "/pause?mode=keep", None), ("POST", "/reset_prefix_cache", None),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tiny_model_dir)}),
             ("POST", "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 1}}),
             ("GET", "/server_info", None), ("GET", "/weight_info", None), ("GET", "/version", None)]
    try:
        for method, route, body in calls:
            for authorization in (None, "Bearer " + "0" * 32, f"Basic {TOKEN}", TOKEN):
                status, text = http(served, route, method, body, authorization)
                assert status == 401, (route, authorization, status, text)
        assert http(served, "/health", authorization=None)[0] == 200
    finally:
        http(served, "/resume", "POST")                          # main: the pause above went through
    assert weight_label(served) == label


@pytest.mark.e2e
def test_a_client_without_the_servers_token_is_refused_in_one_line_naming_it(served, tiny_model_dir, monkeypatch):
    """An engine by URL whose process has no LIT_ESS_SERVER_TOKEN, or another one: one line naming the URL, the
    401 and the variable (main: the server took its calls)."""
    for token, says in ((None, "set LIT_ESS_SERVER_TOKEN to the server's"),
                        ("0" * 32, "this process's LIT_ESS_SERVER_TOKEN is not the server's")):
        if token is None:
            monkeypatch.delenv(TOKEN_ENV)
        else:
            monkeypatch.setenv(TOKEN_ENV, token)
        with pytest.raises(ServerError, match=rf"^vLLM server {served}: GET /version answered HTTP 401 .*{says}") as e:
            VLLMServerConfig(urls=[served], startup_timeout=30).build(tiny_model_dir)
        assert "\n" not in str(e.value)


@pytest.mark.e2e
def test_a_second_server_on_the_port_of_a_running_one_is_refused_in_one_line(served, tiny_model_dir, tmp_path):
    """An engine with `port: P` and `serve --port P` while the module's server listens on P (main: the engine
    took that server for the one it launched and pushed its weights into it): one line naming the port, who
    holds it and the fix, before any vLLM starts."""
    port = int(served.rsplit(":", 1)[1])
    holder = rf"127\.0\.0\.1:{port} is in use by pid \d+ \(\S*python\S* -m vllm\.entrypoints\.openai\.api_server .*\)"
    with pytest.raises(ValueError, match=rf"^engine\.port {port}: {holder}: a launched server needs a port of its "
                                         rf"own: set another engine\.port, or port: null for a free one$"):
        VLLMServerConfig(port=port, startup_timeout=60, log_file=str(tmp_path / "engine.log")).build(tiny_model_dir)
    res = subprocess.run([sys.executable, "-m", "lit_ess.engines.serve", "--model", tiny_model_dir, "--port", str(port),
                          "--log-file", str(tmp_path / "serve.log")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    said = res.stderr.strip()
    assert re.fullmatch(rf"python -m lit_ess\.engines\.serve: error: --port {port}: {holder}: pass another --port",
                        said), said
    assert not (tmp_path / "engine.log").exists() and not (tmp_path / "serve.log").exists()


# ---- users' agents through the server (lit_ess.envs.agent) ----

def _sequence(answer: dict) -> list[int]:
    """An OpenAI answer's prompt ids + sampled ids (chat: prompt_token_ids at the top; completions: in the choice)."""
    choice = answer["choices"][0]
    return (answer.get("prompt_token_ids") or choice["prompt_token_ids"]) + choice["token_ids"]


@pytest.mark.e2e
def test_an_agents_episodes_are_what_the_server_sampled(server, hf_model, tiny_model_dir):
    """Two calls per episode through the OpenAI-compatible URL, as completions and as chat (a chat template
    given to the byte tokenizer: the server sees token ids only): each episode is its last call's prompt
    ids + sampled ids, token for token, with the first call's prompt + reply as its start, and the
    trainer's logprobs of its sampled tokens are the server's (on-policy: every ratio 1)."""
    import agent_fns

    from lit_ess.datamodules.prompts import Arithmetic
    from functools import partial

    from lit_ess.envs import EnvConfig, collate_episodes, make_runner
    from lit_ess.envs.agent import Agent
    from lit_ess.logprobs import sequence_logprobs

    server.load_weights(hf_model.state_dict().items(), version=0)     # the module's earlier tests pushed others
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat.chat_template = ("{% for m in messages %}<|sep|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
                          "{% if add_generation_prompt %}<|sep|>assistant: {% endif %}")
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=4)
    examples = Arithmetic(digits=2, size=3, seed=0).examples
    for fn, t in (("two_completions", tok), ("two_chats", chat)):
        agent_fns.ANSWERS.clear()
        runner = make_runner(EnvConfig(env=partial(Agent, function=f"agent_fns:{fn}"), max_turns=2, step_timeout=120),
                             t, max_error_rate=0.0)
        t0 = time.perf_counter()
        eps = runner.run(server, examples, 2, s, call_seed=1)
        print(f"{fn}: {len(eps)} episodes of 2 calls in {time.perf_counter() - t0:.1f} s")
        runner.close()
        calls = list(agent_fns.ANSWERS.values())
        assert len(eps) == len(calls) == 6 and all(len(c) == 2 for c in calls)
        assert sorted(e.prompt_ids + e.completion_ids for e in eps) == sorted(_sequence(c[1]) for c in calls)
        for first, last in calls:
            assert _sequence(last)[:len(_sequence(first))] == _sequence(first)
        for e in eps:
            assert e.turns == 2 and e.env_tokens > 0 and not e.failed and e.turn_versions == [0, 0]
        batch = collate_episodes(eps, [1.0] * 6, [0] * 6, [""] * 6, tok.pad_token_id)
        with torch.no_grad():
            lp, _ = sequence_logprobs(hf_model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                      s.temperature, s.top_k, s.top_p)
        m = batch.completion_mask
        assert int(m.sum()) == sum(len(c["choices"][0]["token_ids"]) for cs in calls for c in cs)
        assert (lp - batch.behavior_logprobs)[m].abs().max() < 1e-5


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_demo_agent_through_the_server(mode, server, tiny_model_dir, tmp_path):
    """configs/demo_agent.yaml (its agent: OpenAI client code, up to 3 calls per episode), smaller, on the
    module's server by URL: sync, every step's ESS is 1; async (the agents play in the worker process),
    the lag bound holds; more than one call per episode and no failure in both."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "demo_agent.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    d = cfg["data"]["init_args"]
    d["batch"].update(prompts_per_rollout=8, samples_per_prompt=4)
    if mode == "async":
        d["schedule"] = {"mode": "async", "max_staleness": 1}
    d["engine"]["init_args"]["urls"] = server.urls
    d.pop("validation")
    t = cfg["trainer"]
    steps = 2 if mode == "sync" else 3
    t.update(max_steps=steps, enable_progress_bar=False, enable_checkpointing=False)
    t.pop("check_val_every_n_epoch")
    cfg["output_dir"] = None            # the paths below are the test's own
    t["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(tmp_path), "name": "tb", "version": "run"}}
    t["callbacks"] = [c for c in t["callbacks"] if c["class_path"].split(".")[-1] in ("WeightSync", "RatioDashboard")]
    t0 = time.perf_counter()
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    print(f"demo_agent {mode}, {steps} steps of 32 episodes: {time.perf_counter() - t0:.0f} s")
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess = [v for _, v in s["train/ess"]]
    assert len(ess) == steps
    if mode == "sync":
        assert min(ess) >= 0.9999, ess
    else:
        assert max(v for _, v in s["train/policy_lag_max"]) <= 1
    assert min(v for _, v in s["rollout/turns"]) > 1 and max(v for _, v in s["rollout/turns"]) <= 3
    assert [v for _, v in s["rollout/env_errors"]] == [0.0] * steps and min(v for _, v in s["rollout/env_tokens"]) > 0


def own_version_logprobs(models: dict, prompt: list[int], c, s) -> torch.Tensor:
    """[C] the logprob of each of completion `c`'s tokens under the weights of its own version
    (`models`: version -> model), given the tokens before it."""
    ids = torch.tensor([prompt + c.token_ids])
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, len(prompt):] = True
    per_version = {v: sequence_logprobs(m, ids, torch.ones_like(ids), cm, s.temperature, s.top_k, s.top_p)[0][0, len(prompt):]
                   for v, m in models.items()}
    return torch.stack([per_version[v][t] for t, v in enumerate(c.token_versions)])


@pytest.mark.e2e
def test_an_in_flight_update_labels_each_token_with_its_version_and_pi_b(server, hf_model, tiny_model_dir):
    """weight_update: in_flight (a second client of the module's server): weights pushed while requests
    run reach them mid-completion. A completion's tokens before the switch carry the old version and the
    old weights' logprob, those after it the new ones' (the frozen requests' prefix is recomputed with the
    new weights), and its version is its oldest token's."""
    engine = VLLMServerConfig(urls=server.urls, weight_update="in_flight").build(tiny_model_dir)
    new = perturbed(tiny_model_dir, seed=1)
    s = SamplingConfig(temperature=1.0, max_new_tokens=200, seed=21)
    prompts = [[1, 20, 21, 14]]
    mixed, switched = [], None
    for attempt in range(4):                            # the push must land while tokens are being sampled
        old_v, new_v = 30 + 2 * attempt, 31 + 2 * attempt
        engine.load_weights(hf_model.state_dict().items(), version=old_v)     # nothing runs: a plain update
        out = {}
        thread = threading.Thread(target=lambda: out.update(groups=engine.generate(prompts, 16, s, call_seed=attempt)))
        thread.start()
        time.sleep(0.5 + 0.5 * attempt)
        t0 = time.perf_counter()
        engine.load_weights(new.state_dict().items(), version=new_v)
        switched = time.perf_counter() - t0
        thread.join(300)
        group = out["groups"][0]
        models = {old_v: hf_model, new_v: new}
        for c in group:
            assert c.token_versions == sorted(c.token_versions) and set(c.token_versions) <= {old_v, new_v}
            assert c.version == min(c.token_versions)
            gap = (own_version_logprobs(models, prompts[0], c, s) - torch.tensor(c.logprobs)).abs().max().item()
            assert gap < 1e-4, (gap, c.token_versions)
        mixed = [c for c in group if len(set(c.token_versions)) == 2]
        if mixed:
            break
    print(f"in-flight update {switched:.2f} s; {len(mixed)} of 16 completions sampled by two versions, switching "
          f"after {[c.token_versions.index(new_v) for c in mixed]} tokens")
    assert mixed, "no completion was running when the weights changed"
    assert engine.version == new_v and weight_label(server.urls[0]) == str(new_v)
    engine.close()


@pytest.mark.e2e
def test_async_fit_with_in_flight_updates_logs_mixed_rows_within_the_bound(server, tiny_model_dir, tmp_path):
    """`lit-ess fit`, async (S = 2) on the module's server with weight_update: in_flight: weights pushed
    after each step reach the phase being sampled, so rows are sampled by two versions
    (rollout/multi_version_frac > 0); the lag of a row is its oldest token's and never exceeds S, nor
    does any token's (the histogram rollout/token_lag, read back from TensorBoard).

    Whether a push lands while a phase samples is a race (CI once sampled every phase before the step
    that followed it ended); two-turn episodes whose environment waits between the turns for the server
    to hold newer weights make it certain (a drain update would wait for the phase instead)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    S = 2
    log, n = tmp_path / "episodes.jsonl", 2 * 4                   # a phase: 2 prompts x 4 samples
    env = {"env": {"class_path": "e2e_utils.WaitsForNewWeights",
                   "init_args": {"url": server.urls[0], "unmixed": n, "log": str(log), "wait": 20.0}},
           "max_turns": 2, "step_timeout": 60.0}
    cfg = rl_config(tiny_model_dir, tmp_path, max_steps=8, prompts=2, samples=4, extra_data={
        "schedule": {"mode": "async", "max_staleness": S}, "env": env, "sampling": {"temperature": 1.0, "max_new_tokens": 24, "seed": 0},
        "engine": {"class_path": "lit_ess.engines.VLLMServerConfig",
                   "init_args": {"urls": server.urls, "weight_update": "in_flight"}}})
    t0 = time.perf_counter()
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    mixed = [v for _, v in s["rollout/multi_version_frac"]]
    row_lag, row_lag_max = dict(s["train/policy_lag"]), [v for _, v in s["train/policy_lag_max"]]
    token_lag = dict(s["train/token_lag"])
    print(f"fit {time.perf_counter() - t0:.0f} s; multi_version_frac per step {mixed}; row lag {list(row_lag.values())}; "
          f"token lag {list(token_lag.values())}")
    # the first phase is sampled before any push; every later one waits for a push between its turns, unless a
    # push landed between an episode's reset and its first step (raced: it may not be mixed)
    raced = {e["episode"] // n for e in map(json.loads, log.read_text().splitlines()) if e["raced"]}
    print(f"phases with a raced episode: {sorted(raced)}")
    assert len(mixed) == 8 and mixed[0] == 0.0, mixed
    assert all(m == 1.0 for k, m in enumerate(mixed) if k > 0 and k not in raced), (mixed, raced)
    assert len(raced) < 7, raced                        # seen: 0 of 7 (twice), 1 of 7 (once)
    assert max(row_lag_max) <= S, row_lag_max                          # the bound, on each row's oldest token
    assert [v for _, v in s["rollout/stale_dropped"]][-1] == 0
    acc = EventAccumulator(str(tmp_path / "tb" / "run"), size_guidance={"histograms": 0})
    acc.Reload()
    lags = {e.step: (e.histogram_value.min, e.histogram_value.max) for e in acc.Histograms("rollout/token_lag")}
    print(f"token lag (min, max) per step: {lags}")
    assert len(lags) == 8 and all(0 <= lo <= hi <= S for lo, hi in lags.values()), lags   # every token within S
    assert "rollout/policy_lag" in acc.Tags()["histograms"]
