"""Helpers for end-to-end runs: write a config, run `lit-ess` in a subprocess, read TensorBoard."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import yaml

from lit_ess.callbacks import WeightSync
from lit_ess.datamodules.settings import BatchShape
from lit_ess.report import read_scalars


def digit_fraction(completion: str, answer: str) -> float:
    """A graded reward a random model can earn: the share of its characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def rl_config(model_path: str, out: Path, *, engine="VLLMConfig", max_steps=4, steps_per_rollout=1, lr=1e-3,
              prompts=8, samples=4, ckpt_every=None, micro_batch_size=None, objective="P3O", extra_data=None,
              extra_model=None):
    """A small RL config; `engine` and `objective` are class names of lit_ess.engines / lit_ess.objectives.
    extra_data / extra_model are laid over data's and model's init_args (their groups key by key)."""
    callbacks = [
        {"class_path": "lit_ess.callbacks.WeightSync"},
        {"class_path": "lit_ess.callbacks.RatioDashboard", "init_args": {"every_n_steps": 1}},
    ]
    if ckpt_every:
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"dirpath": str(out / "ckpt"), "save_last": True,
                                        "every_n_train_steps": ckpt_every, "save_top_k": -1}})
    data = {"source": {"class_path": "lit_ess.datamodules.Arithmetic", "init_args": {"digits": 2, "size": 500}},
            "engine": {"class_path": f"lit_ess.engines.{engine}"}, "sampling": {"temperature": 1.0, "max_new_tokens": 6, "seed": 0},
            "batch": {"prompts_per_rollout": prompts, "samples_per_prompt": samples, "steps_per_rollout": steps_per_rollout},
            "reward": "e2e_utils:digit_fraction"}
    model = {"model_path": model_path, "optim": {"lr": lr}, "objective": {"class_path": f"lit_ess.objectives.{objective}"},
             "micro_batch": {"size": micro_batch_size}}
    return {
        "seed_everything": 0,
        "model": {"class_path": "lit_ess.module.PolicyModule", "init_args": merged(model, extra_model or {})},
        "data": {"class_path": "lit_ess.datamodules.RolloutDataModule", "init_args": merged(data, extra_data or {})},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_checkpointing": bool(ckpt_every),
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(out), "name": "tb", "version": "run"}},
                    "callbacks": callbacks},
    }


GROUPS = ("batch", "schedule", "reward_limits", "validation", "optim", "micro_batch", "compute", "ess_alarm")


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` laid over it; a group of settings given in both (`batch`, `optim`) merged key by key."""
    return {**base, **extra, **{k: {**base[k], **extra[k]} for k in GROUPS if k in base and k in extra}}


def sampled_batch(model_dir: str):
    """The first batch (16 rows) of one phase sampled by the transformers engine: 4 arithmetic prompts x 4
    samples, at most 6 new tokens, seeded."""
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.engines import HFConfig
    from lit_ess.sampling import SamplingConfig

    dm = RolloutDataModule(model_path=model_dir, engine=HFConfig(), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=4),
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), source=Arithmetic(size=50),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    return dm.generate_phase()[0]


def off_policy(batch):
    """`batch` made off-policy toward both anchors, in place: behaviour logprobs moved by N(0, 0.3) (ESS < 1),
    proximal logprobs (scored at step 0) by another N(0, 0.2) from those, neither the policy's, and
    non-degenerate advantages."""
    import torch

    from lit_ess.batch import Proximal

    g = torch.Generator().manual_seed(0)
    m = batch.completion_mask
    batch.behavior_logprobs = torch.where(m, batch.behavior_logprobs + 0.3 * torch.randn(m.shape, generator=g), 0.0)
    batch.prox_logprobs = torch.where(m, batch.behavior_logprobs + 0.2 * torch.randn(m.shape, generator=g), 0.0)
    batch.proximal = Proximal(0, "scored")
    batch.advantages = torch.randn(m.shape[0], generator=g)
    return batch


def write_config(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def short_run(cfg: dict, out: Path, max_steps: int) -> dict:
    """A shipped config `cfg` cut to a test's run, in place: `max_steps`, no progress bar, no checkpoint, no
    output_dir, TensorBoard in `out` (tb/run), WeightSync its only callback."""
    t = cfg["trainer"]
    t.update(max_steps=max_steps, enable_progress_bar=False, enable_checkpointing=False)
    cfg["output_dir"] = None            # the paths below are the test's own
    t["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(out), "name": "tb", "version": "run"}}
    t["callbacks"] = [c for c in t["callbacks"] if c["class_path"].endswith("WeightSync")]
    return cfg


def pythonpath() -> str:
    """PYTHONPATH for a subprocess: this checkout's code (not whichever checkout the venv was installed
    from) and the tests' helpers (rewards such as e2e_utils:digit_fraction)."""
    here = Path(__file__).resolve().parent
    return os.pathsep.join(filter(None, [str(here.parent), str(here), os.environ.get("PYTHONPATH")]))


def cli(args: list[str], cwd: Path | None = None, timeout: int = 600, env: dict | None = None,
        **popen) -> subprocess.CompletedProcess:
    if cwd is not None:
        Path(cwd).mkdir(parents=True, exist_ok=True)
    env = dict(env or os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-m", "lit_ess.cli", *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True, **popen)


def cli_each(cases: dict, timeout: int = 600) -> dict:
    """`lit-ess ARGS` for each case ({key: (args, cwd)} -> {key: CompletedProcess}), one after another in one Python process, through
    lit_ess.cli.main (the entry point of the command) with the case's folder as `python -m lit_ess.cli`
    has it (current, and first on sys.path) and its own fds 1 and 2: a config refused while it is read
    costs its check, not another start of Python, Lightning and lit-ess (10-25 s each on a loaded machine).
    For runs that end while the config is read (refusals, --print_config), and short fits after them (a
    fit's in-process vLLM engine is dropped at its end, never torn down: the next fit starts its own, as
    test_families' three do): nothing here stops a run but `timeout`, for all the cases together."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "cases.json").write_text(json.dumps([[a, str(Path(c or os.getcwd()).resolve())]
                                                      for a, c in cases.values()]))
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=pythonpath())
        res = subprocess.run([sys.executable, "-c", "import sys, e2e_utils; e2e_utils._cli_each(sys.argv[1])", tmp],
                             env=env, timeout=timeout, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(Path(tmp, "results.json").read_text())
    return {k: subprocess.CompletedProcess(["lit-ess", *a], *r) for (k, (a, _)), r in zip(cases.items(), got, strict=True)}


def _cli_each(folder: str) -> None:
    """cli_each's process: each [args, cwd] of FOLDER/cases.json, as [exit status, stdout, stderr] in FOLDER/results.json."""
    import importlib
    import json
    import tempfile
    import traceback

    import lit_ess.cli

    results = []
    for args, cwd in json.loads(Path(folder, "cases.json").read_text()):
        os.chdir(cwd)
        sys.path[0], sys.argv = cwd, [lit_ess.cli.__file__, *args]
        importlib.invalidate_caches()
        with tempfile.TemporaryFile("w+b") as out, tempfile.TemporaryFile("w+b") as err:
            sys.stdout.flush(), sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            try:
                lit_ess.cli.main(args)
                code = 0
            except SystemExit as e:                   # as the interpreter ends on it
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:                     # as the interpreter ends on an uncaught exception
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
            out.seek(0), err.seek(0)
            results.append([code, out.read().decode(errors="replace"), err.read().decode(errors="replace")])
    Path(folder, "results.json").write_text(json.dumps(results))


# what a quiet console never shows: a warning or deprecation, or a Python warning whatever its wording
# (warnings print as "path/file.py:LINE: message")
NOISE = re.compile(r"warning|deprecat|\.py:\d+: ", re.I)


def noisy_lines(console: str) -> list[str]:
    """The lines of a console output that match NOISE (progress-bar redraws count as lines)."""
    return [ln for ln in re.split(r"[\r\n]", console) if NOISE.search(ln)]


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    return read_scalars(out / "tb" / "run")


def flaky_digit_fraction(completion: str, answer: str) -> float:
    """digit_fraction that raises on completions with an odd character count (counted reward errors)."""
    if len(completion) % 2:
        raise ValueError("flaky reward")
    return digit_fraction(completion, answer)


def varies_unless_const(completion: str, answer: str) -> float:
    """0 for every sample of a prompt whose answer is 'const' (a degenerate group); otherwise a value
    that differs between distinct completions."""
    return 0.0 if answer == "const" else (sum(map(ord, completion)) % 97) / 97


def signal_if_even(completion: str, answer: str) -> float:
    """DAPO's dynamic sampling tests: 0 for every sample of a prompt whose answer is odd (a group without a
    signal); otherwise the parity of the completion's first character, which differs between a group's
    samples of the fake engine (consecutive tokens) and, mostly, of a sampled model."""
    return float(int(answer) % 2 == 0 and bool(completion) and ord(completion[0]) % 2 == 1)


def zero_reward(completion: str, answer: str) -> float:
    """0 for everything: every group is without a signal."""
    return 0.0


class RecordPrompts(L.Callback):
    """A callback for audits: appends each trained step's prompt ids, row versions, phase and batch
    index to a JSONL file; rank r > 0 writes to `path` + `.rank{r}`."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import json

        path = self.path + (f".rank{trainer.global_rank}" if trainer.global_rank else "")
        with open(path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "prompt_ids": batch.prompt_ids.tolist(),
                                "versions": batch.versions.tolist(), "phase": batch.phase,
                                "index": batch.index}) + "\n")


def trained_prompts(path) -> dict[int, dict]:
    """The last record of every step (a step retrained after a resume replaces the killed run's)."""
    import json

    out = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r
    return out


def kill_after_checkpoint(cfg: Path, ckpt_dir: Path, step: int, timeout: float = 300) -> None:
    """Start `lit-ess fit --config cfg`, SIGKILL its process group as soon as the checkpoint of `step`
    exists (mid-run), and check that it was written."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=pythonpath())
    proc = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, last, size = time.time() + timeout, ckpt_dir / "last.ckpt", -1
    while time.time() < deadline and proc.poll() is None:
        # `--ckpt_path last` needs last.ckpt, written right after the step's file: wait until it is whole
        # (a sharded checkpoint is a folder whose meta.pt rank 0 writes last)
        done = last / "meta.pt" if last.is_dir() else last
        if list(ckpt_dir.glob(f"*step={step}*.ckpt")) and done.exists():
            if done.stat().st_size == size:
                break
            size = done.stat().st_size
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:                   # it finished first; the assertions below still hold
        pass
    proc.wait()
    assert list(ckpt_dir.glob(f"*step={step}*.ckpt")) and last.exists(), "no checkpoint was written before the kill"


def kill_when_rewritten(cfg: Path, target: Path, env: dict | None = None, timeout: float = 300) -> None:
    """Start `lit-ess fit --config cfg` and SIGKILL its process group the moment `target` (a checkpoint
    file) changes after its first version appeared: while it is being rewritten, if it ever is in place."""
    import time

    env = dict(env or os.environ, PYTHONPATH=pythonpath())
    proc = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, first = time.time() + timeout, None
    try:
        while time.time() < deadline and proc.poll() is None:
            try:
                st = target.stat()
                now = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                now = None
            if first is None and now is not None:
                time.sleep(0.02)
                st = target.stat()                       # the first version, once its size holds still
                first = now if now == (st.st_ino, st.st_size, st.st_mtime_ns) else None
            elif first is not None and now != first:
                break
            time.sleep(0.0005)
    finally:
        kill_session(proc)
    assert first is not None and time.time() < deadline, f"{target} was not rewritten before the run ended"


class StaleWeightSync(WeightSync):
    """A broken weight sync for tests: every push hands the engine the weights of train start, labelled
    with the current step (what a sync that silently fails looks like)."""

    def __init__(self):
        super().__init__()
        self.first = None

    def push(self, trainer, pl_module) -> None:
        if self.first is None:
            self.first = [(k, v.detach().clone()) for k, v in pl_module.policy_weights()]
        self._receiver(pl_module).push_weights(iter(self.first), version=trainer.global_step)


class SaveSyncPayloads(L.Callback):
    """For LoRA tests: at the end of fit every rank gathers both sync payloads of the policy (merged
    weights and adapters, lit_ess.lora), in the order the engine would receive them; rank 0 saves them
    to `path` as {"merged": [(name, tensor), ...], "adapter": [...]}."""

    def __init__(self, path: str):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        import torch

        from lit_ess.lora import adapter_weights, merged_weights

        got = {mode: [(k, v.detach().cpu().clone()) for k, v in payload(pl_module.policy)]
               for mode, payload in (("merged", merged_weights), ("adapter", adapter_weights))}
        if trainer.is_global_zero:
            torch.save(got, self.path)


def nan_model_copy(src: str, dst: Path, tensor: str = "model.layers.0.mlp.up_proj.weight") -> Path:
    """A copy of the model folder `src` with one NaN written into `tensor`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights[tensor].view(-1)[0] = float("nan")
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


class NaNGradients(L.Callback):
    """Every gradient of one weight becomes NaN from optimizer step `from_step` on (the weights stay
    finite: each step is skipped for a non-finite gradient norm, and the step count no longer moves)."""

    def __init__(self, from_step: int = 0):
        self.from_step = from_step

    def on_train_start(self, trainer, pl_module):
        import torch

        next(p for p in pl_module.policy.parameters() if p.requires_grad).register_hook(
            lambda g: torch.full_like(g, float("nan")) if trainer.global_step >= self.from_step else g)


class NaNWeightAfterStep(L.Callback):
    """Writes a NaN into one policy weight at the end of step `step` (before the weights are pushed
    to the engine: list it before WeightSync)."""

    def __init__(self, step: int = 0):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import torch

        if trainer.global_step - 1 == self.step:
            with torch.no_grad():
                dict(pl_module.policy.named_parameters())["model.layers.0.mlp.up_proj.weight"].view(-1)[0] = float("nan")


class KillRankAt(L.Callback):
    """kill -9 of this process on rank `rank` after optimizer step `step` (a rank that dies mid-run;
    rank 0 is the launcher)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import signal

        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the session `proc` leads (started with start_new_session) and reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def session_processes(sid: int) -> list[int]:
    """The pids of the live processes of session `sid` (a run started with start_new_session)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return out


import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from lit_ess.envs import Environment, RetryArithmetic, Step  # noqa: E402


class FlakyRetry(RetryArithmetic):
    """RetryArithmetic whose step raises on answers of odd length (counted environment errors), the same
    for the same sampled tokens: a resumed run fails where the uninterrupted one did."""

    def step(self, action) -> Step:
        if len(action.text) % 2:
            raise ValueError("flaky environment")
        return super().step(action)


def spawn_ranks(target, *args, world: int = 2, timeout: float = 240, what: str = "the ranks") -> None:
    """Run `target(rank, world, port, *args)` in `world` spawned processes (a free local port for gloo);
    fail when one hangs past `timeout` seconds (mismatched collectives) or exits non-zero."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{what} hung (mismatched collectives)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


class WaitsForNewWeights(Environment):
    """Two turns; between them the environment waits (up to `wait` s) until the server at `url` holds
    weights other than those it held when the first turn ended, so an in-flight update lands inside the
    episode: its turns are sampled by two versions. The first `unmixed` episodes of the process (the first
    phase) do not wait: nothing pushes until a phase is trained. An episode whose weights changed between
    its reset and its first step (a push landed before or during its first turn: which, the environment
    cannot see) does not wait either, since the next push may need this very episode trained; it is
    logged as raced. `log`: one JSON line per episode, {"episode": k, "raced": bool}, k in reset order."""

    started = 0                                   # episodes begun in this (the rollout worker's) process
    lock = threading.Lock()

    def __init__(self, url: str, unmixed: int, log: str, wait: float = 20.0):
        self.url, self.unmixed, self.log, self.wait = url, unmixed, log, wait

    def reset(self, example) -> str:
        with WaitsForNewWeights.lock:
            self.index = WaitsForNewWeights.started
            WaitsForNewWeights.started += 1
        self.label, self.turn = server_weight_label(self.url), 0
        return example.prompt

    def step(self, action) -> Step:
        self.turn += 1
        if self.turn > 1:
            return Step(reward=float(len(action.text) % 3 == 0), done=True)
        now = server_weight_label(self.url)
        raced = now != self.label
        with WaitsForNewWeights.lock, open(self.log, "a") as f:
            f.write(json.dumps({"episode": self.index, "raced": raced}) + "\n")
        deadline = time.monotonic() + self.wait
        while self.index >= self.unmixed and not raced and server_weight_label(self.url) == now \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        return Step(observation="\nagain: ")


def server_weight_label(url: str) -> str:
    """The weight version a vLLM server says it holds (GET /weight_info)."""
    import json
    import urllib.request

    token = os.environ.get("LIT_ESS_SERVER_TOKEN")      # a server guarded by the shared token (docs/server.md)
    req = urllib.request.Request(url + "/weight_info", headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["weight_version"]


class LongFirstObservation(RetryArithmetic):
    """RetryArithmetic whose first observation is the question after `length` characters of preamble for
    the examples whose prompt's character codes sum to an even number (about half of them)."""

    def __init__(self, length: int = 5000, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def reset(self, example) -> str:
        prompt = super().reset(example)
        return "x" * self.length + prompt if sum(map(ord, prompt)) % 2 == 0 else prompt


class RecordRowLengths(L.Callback):
    """Appends each trained batch's longest row (prompt and completion tokens) to the file `path`, one a line."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(f"{int(batch.attention_mask.sum(-1).max())}\n")


class HoldStep(L.Callback):
    """For preemption tests: in step `step`, between backward and optimizer step, every rank of a first
    start (not a Slurm requeue) waits until the file `release` exists (up to 120 s), then `after` s more;
    rank 0 first creates `held`. A signal sent once `held` exists lands mid-step."""

    def __init__(self, step: int, held: str, release: str, after: float = 3.0):
        self.step, self.held, self.release, self.after = step, held, release, after

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        import time

        if trainer.global_step != self.step or os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
            return
        if trainer.is_global_zero:
            Path(self.held).touch()
        deadline = time.monotonic() + 120
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(self.after)
