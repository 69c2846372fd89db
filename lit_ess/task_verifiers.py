"""reasoning-gym's verifiers (the `reasoning-gym` package, `pip install 'lit-ess[envs]'`): a task's dataset built
from its config, and the reward `reasoning_gym` (lit_ess.rewards), which scores a completion with the
`score_answer` of the task that generated the entry (lit_ess.datamodules.ReasoningGym's columns `entry` and
`task`). Here, not in the data layer, so the rewards import it downward.
"""
from __future__ import annotations

import functools
import json
import re

INSTALL = "pip install 'lit-ess[envs]' (or reasoning-gym)"


def registry() -> dict:
    """reasoning-gym's registered tasks, name -> (dataset class, config class); ImportError in one line
    when the package is missing."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(f"ReasoningGym needs the reasoning-gym package ({e}): {INSTALL}") from None
    return DATASETS


def build_dataset(name: str, config: dict):
    """The task's dataset for `config` (validated by reasoning-gym itself); a refusal in one line."""
    from reasoning_gym import create_dataset

    try:
        return create_dataset(name, **config)
    except (AssertionError, ValueError, TypeError) as e:
        why = str(e) or type(e).__name__
        raise ValueError(f"ReasoningGym(task={name!r}).config {config}: reasoning-gym refuses it: {why}") from None


def extract(completion: str, tag: str | None) -> str | None:
    """The answer the reward scores: the last `<tag>...</tag>` span, stripped (None when there is none), or
    with `tag` None the whole completion, stripped."""
    if tag is None:
        return completion.strip()
    spans = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", completion, flags=re.DOTALL)
    return spans[-1].strip() if spans else None


@functools.lru_cache(maxsize=32)
def _verifier(name: str, config_json: str):
    """The task's dataset built from its config (json), for its `score_answer`: one per task and config."""
    return build_dataset(name, json.loads(config_json))


def score(completion: str, entry: dict, task: dict) -> float:
    """The reasoning-gym task's own verdict on a completion: `score_answer(answer, entry)` of the dataset
    the entry came from (`task`: the ReasoningGym source's column). The reward `reasoning_gym`."""
    verifier = _verifier(task["name"], json.dumps(task["config"], sort_keys=True))
    return float(verifier.score_answer(extract(completion, task.get("answer_tag")), entry))
