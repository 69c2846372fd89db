"""Every numeric knob of every typed config class is checked where it is declared.

The classes are found, not listed: the constructors the CLI builds (PolicyModule, SFTModule, their data
modules, every callback of lit_ess.callbacks, the ESS alarm, the environments and their config) and,
recursively, every lit_ess class their parameters are annotated with, each with all its subclasses
(objectives, corrections, engine configs, sampling, LoRA, prompt sources). Each int / float parameter (bare, Optional, in a tuple or a list) is
tried at 0, a negative, NaN and +-inf (None too when it is Optional): the constructor either refuses
with a one-line ValueError naming the knob, or the value is listed in DOCUMENTED with the phrase of the
class's docstring that gives it its meaning. A new numeric field without a rule fails here.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import sys
import types
import typing
from pathlib import Path

import pytest

import lit_ess.callbacks
from lit_ess.datamodules import RolloutDataModule
from lit_ess.datamodules.sft import SFTDataModule
from lit_ess.envs import EnvConfig, Environment
from lit_ess.health import ESSWatch
from lit_ess.module import PolicyModule
from lit_ess.objectives import CISPO, DAPO, GRPO, GSPO, DecoupledPPO
from lit_ess.sft import SFTModule
from lit_ess.settings import MicroBatch, Optim

ROOTS = [PolicyModule, SFTModule, RolloutDataModule, SFTDataModule, ESSWatch, EnvConfig, Environment,
         *(getattr(lit_ess.callbacks, name) for name in lit_ess.callbacks.__all__)]

# (class, knob, value) -> the phrase of the class's docstring that gives the value its meaning
DOCUMENTED = {
    ("Reward", "weight", 0): "0 = logged, not trained on",
    ("Reward", "weight", -1): "a negative weight = a penalty",
    ("Reward", "weight", -0.5): "a negative weight = a penalty",
    ("Optim", "weight_decay", 0): "weight_decay: AdamW weight decay, >= 0 (0 = none)",
    ("Optim", "betas[0]", 0): "betas: AdamW betas, each in [0, 1)",
    ("Optim", "betas[1]", 0): "betas: AdamW betas, each in [0, 1)",
    ("Optim", "warmup_steps", 0): "warmup_steps: linear warm-up steps, >= 0 (0 = none)",
    ("Optim", "min_lr_ratio", 0): "min_lr_ratio: final learning rate as a fraction of lr, in [0, 1] (0 = decay to 0)",
    ("Optim", "max_grad_norm", None): "None = no clipping",
    ("MicroBatch", "size", None): "(None = the whole step at once)",
    ("MicroBatch", "tokens", None): "None (default) = size decides",
    ("PolicyModule", "train_temperature", None): "None = the rollout's (on-policy)",
    ("Compute", "logprob_chunk", None): "null = the plain path: the model's full logits of the completion span",
    ("SFTModule", "weight_decay", 0): "weight_decay: AdamW weight decay, >= 0 (0 = none)",
    ("SFTModule", "warmup_steps", 0): "then constant; >= 0 (0 = none)",
    ("RewardLimits", "max_error_rate", 0): "0.0: stop at the first failure",
    ("Schedule", "max_staleness", 0): "(0 = on-policy, with steps_per_rollout 1)",
    ("Schedule", "max_staleness", None): "None = steps_per_rollout - 1",
    ("RolloutDataModule", "max_prompt_tokens", None): "None = the room the engine's model length leaves",
    ("BatchShape", "steps_per_epoch", None): "steps_per_epoch: batches per Lightning epoch (None = steps_per_rollout",
    ("RolloutDataModule", "seed", 0): "seed: prompt order and row shuffling (an integer >= 0)",
    ("SFTDataModule", "label_noise", 0): "(0 = none)",
    ("SFTDataModule", "seed", 0): "seed: shuffling and label noise (an integer >= 0)",
    ("ESSAlarm", "threshold", None): "(in (0, 1]; None = off)",
    ("StepProgressBar", "refresh_rate", 0): "(0 = off)",
    ("ModelSummary", "max_depth", 0): "(0 = no table, -1 = every depth)",
    ("ModelSummary", "max_depth", -1): "(0 = no table, -1 = every depth)",
    ("Objective", "entropy_coef", 0): "(0 = off)",
    ("Objective", "ref_kl_coef", 0): "(0 = off;",
    ("Objective", "norm_len", None): "None = the rollout's max_new_tokens",
    ("CISPO", "clip_low", None): "None = no lower bound",
    ("ISCorrection", "low", None): "None = none for truncate",
    ("ISCorrection", "low", 0): "0 = none",
    ("SamplingConfig", "top_k", -1): "top_k: keep the k most likely tokens (-1 = off)",
    ("SamplingConfig", "seed", 0): "seed: base seed, an integer >= 0",
    ("SamplingConfig", "seed", None): "None = unseeded",
    ("VLLMConfig", "gpu_memory_utilization", None): "None = 0.1 on CPU, 0.4 on CUDA",
    ("VLLMConfig", "max_model_len", None): "None = the model's",
    ("VLLMConfig", "seed", 0): "seed: the engine's own seed, an integer >= 0",
    ("VLLMConfig", "worker_devices", None): "None (default) = colocated",
    ("VLLMConfig", "worker_devices[]", 0): "A list of device indices (as the trainer's process numbers them",
    ("VLLMConfig", "max_lora_rank", None): "None = off",
    ("VLLMServerConfig", "gpu_memory_utilization", None): "None = 0.1 on CPU, 0.4 on CUDA",
    ("VLLMServerConfig", "max_model_len", None): "None = the model's",
    ("LLMJudge", "max_model_len", None): "None = the model's",
    ("LLMJudge", "gpu_memory_utilization", None): "None = 0.1 on CPU, 0.4 on CUDA",
    ("LLMJudge", "temperature", 0): "0 = greedy",
    ("VLLMServerConfig", "seed", 0): "seed: launched server: the engine's own seed, an integer >= 0",
    ("VLLMServerConfig", "port", None): "None = a free one",
    ("VLLMServerConfig", "max_lora_rank", None): "None = off (merged pushes)",
    ("VLLMServerConfig", "heartbeat_seconds", None): "None = off",
    ("VLLMServerConfig", "worker_devices", None): "None = the rank's own devices (colocated;",
    ("VLLMServerConfig", "worker_devices[]", 0): "the GPUs it runs on (indices as the trainer's process numbers them",
    ("LoRA", "dropout", 0): "dropout: dropout on the adapter's input, in [0, 1) (0 = none)",
    ("Arithmetic", "seed", 0): "seed: draws the example pool (an integer >= 0)",
    ("ReasoningGym", "seed", 0): "seed: the task's generator seed (an integer >= 0)",
    ("VerifiersTasks", "limit", None): "None = all (the taskset must be finite)",
    ("HFPrompts", "limit", None): "None = all",
    ("EnvConfig", "max_episode_tokens", None): "None: the engine's model length",
    ("Calculator", "max_calls", 0): "(>= 0; 0 = a call ends the episode with reward 0)",
    ("OverlongPenalty", "buffer", None): "None = a fifth of max_length",
    ("OverlongPenalty", "max_length", None): "None = sampling.max_new_tokens",
}
# knobs a message names otherwise than the parameter (none since the groups: each names its full key)
SPELLED: dict[tuple[str, str], str] = {}


def _hints(cls) -> dict[str, object]:
    """The annotation of each constructor parameter of `cls` (all must have one)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    if cls.__init__ is object.__init__:
        return {}
    hints = typing.get_type_hints(cls.__init__)
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p.name for p in params if p.name not in hints]
    assert not missing, f"{cls.__name__}: parameters without a type cannot be checked here: {missing}"
    return {p.name: hints[p.name] for p in params}


def _members(tp) -> list:
    """The alternatives of a union (Optional included), else [tp]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return list(typing.get_args(tp))
    return [tp]


def _lit_ess_classes(tp) -> list[type]:
    """Every lit_ess class inside an annotation (unions, lists, dicts, ...)."""
    if isinstance(tp, type) and tp.__module__.startswith("lit_ess"):
        return [tp]
    return [c for arg in typing.get_args(tp) for c in _lit_ess_classes(arg)]


def _is_number(tp) -> bool:
    return tp in (int, float)


def _numeric_shape(tp) -> str | None:
    """'scalar', 'tuple' or 'list' for a numeric annotation, else None."""
    for m in _members(tp):
        if _is_number(m):
            return "scalar"
        args = typing.get_args(m)
        if typing.get_origin(m) is tuple and args and all(_is_number(a) or a is Ellipsis for a in args):
            return "tuple"
        if typing.get_origin(m) is list and args and _is_number(args[0]):
            return "list"
    return None


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def knob_classes() -> list[type]:
    """The roots and every lit_ess class reachable through constructor annotations, with subclasses;
    private (_Name) and abstract classes left out."""
    seen, queue = [], [c for root in ROOTS for c in (root, *_subclasses(root))]
    while queue:
        cls = queue.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        for tp in _hints(cls).values():
            for found in _lit_ess_classes(tp):
                queue += [found, *_subclasses(found)]
    return [c for c in seen if c.__module__.startswith("lit_ess") and not c.__name__.startswith("_")
            and not inspect.isabstract(c)]


def trials(cls: type) -> list[tuple[str, str, object, dict]]:
    """(knob, label, value, constructor override) for each numeric parameter of `cls`."""
    out = []
    sig = inspect.signature(cls)
    for name, tp in _hints(cls).items():
        shape = _numeric_shape(tp)
        if shape is None:
            continue
        floats = any(m is float or float in typing.get_args(m) for m in _members(tp))
        values = [0, -1, *([-0.5] if floats else []), math.nan, math.inf, -math.inf]
        if shape == "scalar":
            out += [(name, name, v, {name: v}) for v in values]
        elif shape == "tuple":
            default = sig.parameters[name].default
            for i in range(len(default)):
                out += [(name, f"{name}[{i}]", v, {name: tuple(v if j == i else d for j, d in enumerate(default))})
                        for v in values]
        else:
            out += [(name, f"{name}[]", v, {name: [v]}) for v in values]
        if type(None) in _members(tp):
            out.append((name, name, None, {name: None}))
    return out


def _documented(cls: type, knob: str, label: str, value) -> tuple[type, str] | None:
    for c in cls.__mro__:
        phrase = DOCUMENTED.get((c.__name__, label, value))
        if phrase is not None and not (isinstance(value, float) and math.isnan(value)):
            return c, phrase
    return None


@pytest.fixture(scope="module")
def required(tiny_model_dir, tmp_path_factory):
    """Values for the constructor parameters without a default."""
    rows = tmp_path_factory.mktemp("knobs") / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    # model: lit_ess.engines.LLMJudge (a launched judge needs a model folder); fn: lit_ess.rewards.Reward; task: lit_ess.datamodules.ReasoningGym (a reasoning-gym task); env:
    # lit_ess.datamodules.VerifiersTasks, the demo's taskset (configs/vf_retry_arithmetic.py, found beside it)
    configs = str(Path(__file__).resolve().parents[1] / "configs")
    sys.path.insert(0, configs)
    yield {"model_path": tiny_model_dir, "model": tiny_model_dir, "path": str(rows), "fn": "exact_match", "task": "chain_sum",
           "env": {"taskset": {"id": "vf_retry_arithmetic", "size": 8, "seed": 0}}}
    sys.path.remove(configs)


def build(cls: type, required: dict, **override):
    needed = [p.name for p in inspect.signature(cls).parameters.values()
              if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    kwargs = {name: required[name] for name in needed if name not in override}
    return cls(**kwargs, **override)


CLASSES = knob_classes()


def test_the_walk_finds_every_kind_of_config():
    names = {c.__name__ for c in CLASSES}
    assert {"PolicyModule", "SFTModule", "RolloutDataModule", "SFTDataModule", "ESSAlarm", "P3O", "GRPO", "DAPO",
            "GSPO", "CISPO", "DecoupledPPO", "REINFORCE", "ISCorrection", "LoRA", "VLLMConfig", "HFConfig",
            "SamplingConfig", "Arithmetic", "HFPrompts", "LogCompletions", "RatioDashboard", "StepProgressBar",
            "ModelSummary", "WeightSync", "EnvConfig", "RetryArithmetic", "Calculator"} <= names, names
    from lit_ess.objectives import OBJECTIVE_CLASSES

    assert set(OBJECTIVE_CLASSES) <= set(CLASSES)


@pytest.mark.parametrize("cls", [c for c in CLASSES if trials(c)], ids=lambda c: c.__name__)
def test_every_numeric_knob_is_refused_on_one_line_or_documented(cls, required):
    build(cls, required)                                     # the defaults are valid
    problems = []
    for knob, label, value, override in trials(cls):
        documented = _documented(cls, knob, label, value)
        try:
            build(cls, required, **override)
        except ValueError as e:
            message = str(e)
            spelled = SPELLED.get((cls.__name__, knob), knob)
            if "\n" in message or not re.search(rf"\b{re.escape(spelled)}\b", message):
                problems.append(f"{label}={value!r}: the message does not name {knob} on one line: {message!r}")
            elif documented is not None:
                problems.append(f"{label}={value!r} is listed as meaningful but refused: {message!r}")
            continue
        except Exception as e:                               # noqa: BLE001 - any other error is the finding
            problems.append(f"{label}={value!r}: {type(e).__name__} instead of a ValueError naming it: {e}")
            continue
        if documented is None:
            problems.append(f"{label}={value!r} is accepted but has no rule: refuse it in {cls.__name__}'s "
                            f"constructor, or document its meaning and list it in DOCUMENTED")
            continue
        owner, phrase = documented
        owner_doc = " ".join((owner.__doc__ or "").split())
        if " ".join(phrase.split()) not in owner_doc:
            problems.append(f"{label}={value!r}: {owner.__name__}'s docstring does not say {phrase!r}")
    assert not problems, "\n".join(problems)


def test_documented_table_has_no_stale_entries():
    tried = {(c.__name__, label, value) for cls in CLASSES for _, label, value, _ in trials(cls)
             for c in cls.__mro__ if c.__module__.startswith("lit_ess")}
    assert set(DOCUMENTED) <= tried, set(DOCUMENTED) - tried


# The findings of issue 25, each as a user would write it.

def test_max_grad_norm_zero_or_minus_one_is_refused_not_a_wrong_update(tiny_model_dir):
    # clip_grad_norm_ scales every gradient by max_norm / norm: -1 flipped its sign (gradient ascent), 0 zeroed it
    for value in (-1, 0, -1.0):
        with pytest.raises(ValueError, match=rf"^model.optim.max_grad_norm must be > 0 or null, got {value}: use null for no "
                                             rf"clipping$"):
            PolicyModule(tiny_model_dir, optim=Optim(max_grad_norm=value))
    assert PolicyModule(tiny_model_dir, optim=Optim(max_grad_norm=None)).optim.max_grad_norm is None


@pytest.mark.parametrize("cls, bad", [(GRPO, dict(clip_eps=-0.5)), (DAPO, dict(clip_high=-0.5)),
                                      (DAPO, dict(clip_low=0.0)), (GSPO, dict(clip_low=-3e-4)),
                                      (CISPO, dict(clip_high=-0.5)), (CISPO, dict(clip_low=1.5)),
                                      (DecoupledPPO, dict(clip_eps=-0.2)), (DecoupledPPO, dict(behavior_cap=-1.0)),
                                      (GRPO, dict(entropy_coef=math.nan))],
                         ids=lambda v: v.__name__ if isinstance(v, type) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_empty_clip_ranges_and_bad_bounds_are_refused_at_construction(cls, bad):
    # GRPO clip_eps -0.5 / DAPO clip_high -0.5 left an empty clip range (no gradient for A > 0);
    # DecoupledPPO behavior_cap -1 failed at the first step with "math domain error"
    (knob, value), = bad.items()
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{knob} must be .*, got {value}$"):
        cls(**bad)


def test_zero_train_temperature_and_micro_batch_size_are_refused_not_read_as_unset(tiny_model_dir):
    with pytest.raises(ValueError, match=r"^model.train_temperature must be > 0 or null, got 0$"):
        PolicyModule(tiny_model_dir, train_temperature=0)
    with pytest.raises(ValueError, match=r"^model.micro_batch.size must be an integer >= 1 or null, got 0$"):
        PolicyModule(tiny_model_dir, micro_batch=MicroBatch(size=0))


def test_seq_mean_token_sum_norm_refuses_a_zero_length():
    import torch

    from lit_ess.objectives import aggregate

    x, m = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    assert aggregate(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(6 / (2 * 3))     # None = T
    with pytest.raises(ValueError, match="^norm_len must be >= 1 or null, got 0$"):       # was silently T
        aggregate(x, m, "seq-mean-token-sum-norm", norm_len=0)


def test_clip_gradients_refuses_a_norm_that_would_negate_or_zero_the_gradient():
    import torch

    from lit_ess.step import clip_gradients

    w = torch.nn.Parameter(torch.zeros(2))
    for bad in (-1.0, 0.0):                          # clip_grad_norm_ would scale g = [3, 4] by bad / 5
        w.grad = torch.tensor([3.0, 4.0])
        with pytest.raises(ValueError, match=r"^max_grad_norm must be > 0 or null, got .*: use null for no clipping$"):
            clip_gradients([w], bad)
        assert w.grad.tolist() == [3.0, 4.0]
    assert clip_gradients([w], 1.0).item() == pytest.approx(5.0)
    assert w.grad.tolist() == pytest.approx([0.6, 0.8])
    w.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients([w], None).item() == pytest.approx(5.0) and w.grad.tolist() == [3.0, 4.0]


def test_reference_loop_checks_max_grad_norm_before_loading_anything(tmp_path):
    """`python -m lit_ess.reference --max_grad_norm -1` is refused before the model and engine load (review
    of issue 25: the check ran at the first optimizer step, after the engine start and the first rollout)."""
    from lit_ess.reference import main

    with pytest.raises(ValueError, match="max_grad_norm"):
        main(["--model_path", str(tmp_path / "absent"), "--max_grad_norm", "-1"])


def test_plain_values_load_with_weights_only(tmp_path):
    """What the data module logs and checkpoints of an environment's typed arguments and a user's estimator (a
    subclass that is no dataclass) is plain values: torch.load(weights_only=True), Lightning's default, reads it."""
    import dataclasses
    import functools

    import torch

    from lit_ess.advantages import Advantage
    from lit_ess.envs import EnvConfig, RetryArithmetic
    from lit_ess.knobs import plain

    @dataclasses.dataclass
    class Opts:
        tries: int = 3

    class Flat(Advantage):                       # no dataclass: a user's estimator as the docs describe it
        def __init__(self):
            self.scale = 2.0

        def estimate(self, rewards):
            return self.scale * (rewards - rewards.mean(1, keepdim=True))

    assert plain({"o": Opts(), "f": len, "t": (1, None)}) == {
        "o": {"class_path": f"{Opts.__module__}.{Opts.__qualname__}", "init_args": {"tries": 3}},
        "f": "builtins.len", "t": [1, None]}
    env = EnvConfig(env=functools.partial(RetryArithmetic, max_tries=3))
    saved = {"env": env.hparams(), "advantage": Flat().hparams(), "opts": plain(Opts())}
    torch.save(saved, tmp_path / "h.pt")
    assert torch.load(tmp_path / "h.pt", weights_only=True) == saved
    assert saved["advantage"] == {"name": "Flat", "scale": 2.0}
