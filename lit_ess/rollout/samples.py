"""What a sample of a phase is, one interface and two answers: a completion scored by the reward
(`Completions`, the default) or an episode of an environment (`Episodes`, `WorkerConfig.env`).

The worker (lit_ess/rollout/worker.py) asks the same five things of either, in this order:

    groups, texts, env = samples.sample(engine, req)          # [P][n] samples, [P * n] texts (stage 1)
    rewards            = samples.rewards(req, groups, texts)  # [P, n]                       (stage 2)
    lengths, cut       = samples.lengths(groups)              # [P * n] policy tokens, share cut by max_new_tokens
    row                = samples.row(req, g, sample, text, advantage, reward)
    stats              = samples.stats(groups, env)           # the kind's own rollout/* statistics

A completion's reward comes from the RewardScorer (weighted lists, batched, async and model rewards, the
killable reward worker, the reward counters), in the scoring stage, which the worker process overlaps with
the next phase's sampling. An episode's reward is what its environment's steps gave while it was played.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lit_ess.batch import Row
from lit_ess.envs import Episode, EpisodeRunner, episode_stats, to_row
from lit_ess.envs.base import Example
from lit_ess.rewards import RewardScorer
from lit_ess.sampling import Completion, SamplingConfig

from .requests import RolloutRequest


class Samples(Protocol):
    def sample(self, engine, req: RolloutRequest) -> tuple[list[list], list[str], dict[str, int] | None]:
        """n samples per prompt `[P][n]`, their texts `[P * n]`, and the environment's cumulative failure
        counters once this phase's samples were drawn (None: no environment)."""

    def rewards(self, req: RolloutRequest, groups: list[list], texts: list[str]) -> torch.Tensor:
        """The samples' rewards `[P, n]`."""

    def lengths(self, groups: list[list]) -> tuple[torch.Tensor, float]:
        """The policy's tokens per sample `[P * n]`, and the share of its generations cut by max_new_tokens."""

    def row(self, req: RolloutRequest, g: int, sample, text: str, advantage: float, reward: float) -> Row:
        """The batch row of prompt g's `sample`."""

    def stats(self, groups: list[list], env: dict[str, int] | None) -> dict[str, float]:
        """This kind's own phase statistics."""

    def counters(self) -> dict:
        """Cumulative failure counters to checkpoint (beside the scorer's)."""

    def load_counters(self, state: dict) -> None: ...

    def close(self) -> None: ...


@dataclass
class Completions:
    """A sample is one completion of the prompt, decoded and scored by `scorer`."""
    tokenizer: object
    scorer: RewardScorer
    n: int
    sampling: SamplingConfig

    def sample(self, engine, req):
        groups = engine.generate(req.prompts, self.n, self.sampling, call_seed=req.phase, prompt_keys=req.prompt_keys)
        return groups, [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for g in groups for s in g], None

    def rewards(self, req, groups: list[list[Completion]], texts):
        n = self.n
        rewards = self.scorer(texts, repeat(req.answers, n), repeat(req.prompt_texts, n),
                              repeat(row_columns(req.columns, len(groups)), n),
                              repeat(req.conversations or [None] * len(groups), n))
        return torch.tensor(rewards, dtype=torch.float32).view(len(groups), n)

    def lengths(self, groups: list[list[Completion]]):
        lengths = torch.tensor([len(s.token_ids) for g in groups for s in g], dtype=torch.float32)
        return lengths, sum(s.finish_reason == "length" for g in groups for s in g) / lengths.numel()

    def row(self, req, g, sample: Completion, text, advantage, reward):
        return Row(prompt=req.prompts[g], completion=sample.token_ids, logprobs=sample.logprobs, advantage=advantage,
                   reward=reward, version=sample.version, prompt_id=req.prompt_ids[g], prompt_text=req.prompt_texts[g],
                   completion_text=text, token_versions=sample.token_versions)

    def stats(self, groups, env):
        return {}

    def counters(self) -> dict:
        return {}

    def load_counters(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Episodes:
    """A sample is an episode of the environment that `runner` plays; its reward is the environment's."""
    runner: EpisodeRunner
    n: int
    sampling: SamplingConfig

    def sample(self, engine, req):
        examples = [Example(p, a, r)
                    for p, a, r in zip(req.prompt_texts, req.answers, row_columns(req.columns, len(req.answers)))]
        eps = self.runner.run(engine, examples, self.n, self.sampling, call_seed=req.phase, prompt_keys=req.prompt_keys)
        groups = [eps[i * self.n:(i + 1) * self.n] for i in range(len(req.prompts))]
        return groups, [e.text() for e in eps], self.runner.state_dict()

    def rewards(self, req, groups: list[list[Episode]], texts):
        return torch.tensor([[e.reward for e in g] for g in groups], dtype=torch.float32).view(len(groups), self.n)

    def lengths(self, groups: list[list[Episode]]):
        # the policy's tokens of an episode; the share of its turns cut by max_new_tokens
        lengths = torch.tensor([sum(e.mask) for g in groups for e in g], dtype=torch.float32)
        reasons = [r for g in groups for e in g for r in e.finish_reasons]
        return lengths, sum(r == "length" for r in reasons) / max(len(reasons), 1)

    def row(self, req, g, sample: Episode, text, advantage, reward):
        row = to_row(sample, advantage, req.prompt_ids[g], req.prompt_texts[g])
        row.reward = reward                  # the reward trained on (DAPO's overlong penalty added)
        return row

    def stats(self, groups, env):
        return {**episode_stats([e for g in groups for e in g]),
                "rollout/env_errors": float(env["errors"]), "rollout/env_timeouts": float(env["timeouts"])}

    def counters(self) -> dict:
        return {"env": self.runner.state_dict()}

    def load_counters(self, state: dict) -> None:
        self.runner.load_state_dict(state.get("env", {}))

    def close(self) -> None:
        self.runner.close()


def repeat(xs: list, n: int) -> list:
    """Per prompt -> per sample: each item n times, in order."""
    return [x for x in xs for _ in range(n)]


def row_columns(columns: list[dict] | None, k: int) -> list[dict]:
    """Each prompt's dataset row (empty for a source without columns)."""
    return columns if columns is not None else [{}] * k
