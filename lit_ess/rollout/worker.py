"""RolloutWorker: prompts -> engine -> rewards -> group advantages -> optimizer-step batches.

With an environment (`WorkerConfig.env`, lit_ess/envs) a sample is an episode: the policy and the
environment take turns (lit_ess.envs.EpisodeRunner, token in, token out) and the episode's reward is
what the environment's steps gave; a row is the whole episode, its environment tokens masked
(`Row.mask`), its version the oldest turn's. Without one (the default) a sample is one completion
scored by the reward. The worker asks either kind the same questions (lit_ess/rollout/samples.py).

One `RolloutRequest` is one rollout *phase*: `P` prompts (chosen by the DataModule, which owns the
prompt cursor) x `n` samples each, split into `steps_per_rollout` batches. With DAPO's dynamic sampling
(`WorkerConfig.filter_groups`) it is one *round* of a phase instead: the result holds every group's rows
and whether it carries a signal, and the DataModule assembles the phase from its rounds
(lit_ess/rollout/dapo.py). DAPO's overlong penalty (`WorkerConfig.overlong`) is added to the rewards
before the group advantages, in either case. The worker holds the engine
and the reward scorer; it runs in the trainer's process (sync mode) or in its own (async mode, see
`process.py`), and it is the same code in both.

A phase has two stages: `sample` (the engine) and `score` (rewards and batching, no engine). In the
trainer's process they run one after the other; the worker process scores a phase in a thread while
its engine samples the next one, so a reward that waits (a remote verifier) overlaps generation.

Weights change between requests, so every token of a phase is sampled by one policy version, unless
the engine takes them in flight (`EngineConfig.updates_in_flight`): then a row's tokens may have several
(`RolloutBatch.token_versions`, `rollout/multi_version_frac`: the share of rows with two or more), and
the row's version (`RolloutBatch.versions`, the one the staleness bound checks) is its oldest token's.

Counters that survive a resume (`counters`, `load_counters`): the reward scorer's failures, and the
environment's (`"env"`), each cumulative and logged as rollout/reward_* and rollout/env_*. A phase's
result carries them as they stood after its own stages: the environment fails while sampling, the
reward while scoring, and the worker process samples phase p + 1 while it scores phase p.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import torch

from lit_ess.advantages import Advantage, GroupMean, degenerate_groups
from lit_ess.batch import EvalResult, RolloutBatch, Row, collate
from lit_ess.engines import EngineConfig
from lit_ess.envs import EnvConfig, Episode, make_runner
from lit_ess.rewards import RewardScorer
from lit_ess.sampling import Completion, SamplingConfig, derive_seed

from .dapo import METRICS, OverlongPenalty, overlong_penalty
from .requests import EvalRequest, RolloutRequest
from .samples import Completions, Episodes, Samples, repeat, row_columns


@dataclass
class PhaseResult:
    """A phase's batches; under dynamic sampling (`WorkerConfig.filter_groups`) one round of it instead: every
    group's rows (`groups`, in prompt order), whether each carries a signal (`keep`) and the round's
    statistics (`stats`), which the data module assembles into the phase (lit_ess/rollout/dapo.py)."""
    phase: int
    batches: list[RolloutBatch]
    reward_counters: dict
    gen_seconds: float
    round: int = 0
    groups: list[list[Row]] | None = None
    keep: list[bool] | None = None
    stats: dict | None = None


@dataclass(kw_only=True)
class WorkerConfig:
    """Everything a worker needs to start, as plain values (so a child process can build it)."""
    model_path: str
    engine: EngineConfig
    sampling: SamplingConfig
    reward: str | list = "exact_match"      # data.reward: a name or a list of lit_ess.rewards.Reward
    reward_timeout: float = 5.0
    samples_per_prompt: int = 8
    steps_per_rollout: int = 1
    advantage: Advantage = field(default_factory=GroupMean)   # rewards [G, n] -> advantages [G, n]
    drop_degenerate: bool = False
    seed: int = 0
    max_staleness: int = 0
    reward_counters: dict = field(default_factory=dict)
    max_reward_error_rate: float = 0.5
    reward_in_worker: bool | None = None
    env: EnvConfig | None = None       # episodes of this environment (None: one completion per sample, scored)
    prompt_limit: int | None = None    # the longest first observation of an episode played (max_prompt_tokens)
    overlong: OverlongPenalty | None = None   # DAPO's overlong penalty, resolved (max_length, buffer set); None: off
    filter_groups: str | None = None   # dynamic sampling: "reward" | "shaped", the groups' signal; a result is a
                                       # round (groups, not batches). None: off

    def __post_init__(self):
        if self.filter_groups not in (None, *METRICS):
            raise ValueError(f"WorkerConfig.filter_groups={self.filter_groups!r} is not one of {(None, *METRICS)}")
        if self.overlong is not None and (self.overlong.max_length is None or self.overlong.buffer is None):
            raise ValueError("WorkerConfig.overlong must be resolved (OverlongPenalty.resolved): max_length and buffer set")


class RolloutWorker:
    """The engine, the reward scorer and the phase's kind of sample (lit_ess/rollout/samples.py: completions, or
    episodes of an environment) of one rank. Whoever holds it loads the engine's weights: InlineExecutor (sync)
    directly, the worker process (async) through its transport."""

    def __init__(self, config: WorkerConfig):
        from transformers import AutoTokenizer

        self.config = c = config
        self.tokenizer = AutoTokenizer.from_pretrained(c.model_path)
        self.pad_id = pad_token_id(self.tokenizer)
        self.scorer = RewardScorer(c.reward, c.reward_timeout, max_error_rate=c.max_reward_error_rate,
                                   in_worker=c.reward_in_worker)
        self.samples: Samples = Completions(self.tokenizer, self.scorer, c.samples_per_prompt, c.sampling)
        if c.env is not None:
            env, limit = c.env, c.engine.model_len(c.model_path)
            if env.max_episode_tokens is None and limit is not None:
                env = replace(env, max_episode_tokens=limit[0])
            self.samples = Episodes(make_runner(env, self.tokenizer, max_error_rate=c.max_reward_error_rate,
                                                prompt_limit=c.prompt_limit), c.samples_per_prompt, c.sampling)
        self.load_counters(c.reward_counters)
        self.engine = c.engine.build(c.model_path)

    @property
    def version(self) -> int:
        return self.engine.version

    def warm_up(self) -> None:
        """Load the model rewards (a judge's server launched) and start the reward worker, so the first phase's
        reward time holds none of it. Sync: InlineExecutor.start; async: the worker process's scoring thread,
        first, beside the first phase's sampling (after Ready: the trainer's weight transport waits for none of it)."""
        self.scorer.warm_up()

    def counters(self) -> dict:
        """The cumulative failure counters, for checkpoints: the scorer's, and the environment's under "env"."""
        return {**self.scorer.state_dict(), **self.samples.counters()}

    def load_counters(self, state: dict) -> None:
        """A resumed run's counters (`counters`); {} leaves them at 0."""
        if state:
            self.scorer.load_state_dict(state)
            self.samples.load_counters(state)

    def run(self, req: RolloutRequest) -> PhaseResult:
        return self.score(req, *self.sample(req))

    @torch.no_grad()
    def sample(self, req: RolloutRequest) -> tuple[list[list[Completion]] | list[list[Episode]], list[str],
                                                   float, dict[str, int] | None]:
        """Stage 1, the engine: n completions (or, with an environment, episodes) per prompt, their texts,
        the generation time (an episode's environment steps included) and the environment's cumulative
        failure counters once this phase's episodes ended (None without an environment)."""
        t0 = time.perf_counter()
        groups, texts, env_counters = self.samples.sample(self.engine, req)
        return groups, texts, time.perf_counter() - t0, env_counters

    def rewards(self, req: RolloutRequest, groups: list[list[Completion]] | list[list[Episode]],
                texts: list[str]) -> tuple[torch.Tensor, float]:
        """The rewards `[P, n]` of a phase's samples (an episode's are its environment's), and the seconds
        they took."""
        t0 = time.perf_counter()
        rewards = self.samples.rewards(req, groups, texts)
        return rewards, time.perf_counter() - t0

    def score(self, req: RolloutRequest, groups: list[list[Completion]] | list[list[Episode]], texts: list[str],
              t_gen: float, env_counters: dict[str, int] | None) -> PhaseResult:
        """Stage 2, no engine: rewards, group advantages, rows, the phase's batches and statistics. (The worker process
        runs it in a thread, beside the next phase's sampling: the environment's counters are those `sample`
        left, `env_counters`, not the runner's now.)"""
        c, n = self.config, self.config.samples_per_prompt
        rewards, t_reward = self.rewards(req, groups, texts)
        lengths, cut = self.samples.lengths(groups)
        shaped = rewards                                    # the rewards trained on: with DAPO's overlong penalty
        if c.overlong is not None:
            penalty = overlong_penalty(lengths, c.overlong.max_length, c.overlong.buffer, c.overlong.factor)
            shaped = rewards + penalty.view_as(rewards)
        adv, degenerate = c.advantage(shaped), degenerate_groups(shaped)             # [G, n], [G]

        if c.filter_groups is not None:                     # dynamic sampling: every group, and which carry a signal
            keep = list(range(len(groups)))
            signal = ~(degenerate if c.filter_groups == "shaped" else degenerate_groups(rewards))
        else:
            keep = [g for g in range(len(groups)) if not (c.drop_degenerate and degenerate[g])]
            # every optimizer step needs at least one row: restore dropped groups (zero advantage) in order
            restore = [g for g in range(len(groups)) if g not in keep]
            while len(keep) * n < c.steps_per_rollout:
                keep.append(restore.pop(0))
        rows = [self.samples.row(req, g, groups[g][j], texts[g * n + j], float(adv[g, j]), float(shaped[g, j]))
                for g in keep for j in range(n)]
        # the environment's counters as this phase's sampling left them (the runner may be a phase ahead)
        counts = {**self.counters(), **({"env": dict(env_counters)} if env_counters is not None else {})}

        stats = {
            "rollout/reward_mean": float(rewards.mean()),
            **({f"train/reward/{k}": v for k, v in self.scorer.parts.items()} if isinstance(c.reward, list) else {}),
            "rollout/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "rollout/rows": float(rewards.numel()),
            "rollout/response_len": float(lengths.mean()),
            "rollout/response_len_max": float(lengths.max()),
            "rollout/truncated_frac": cut,
            "rollout/degenerate_frac": float(degenerate.float().mean()),
            "rollout/dropped_groups": float((~signal).sum()) if c.filter_groups is not None else float(len(groups) - len(keep)),
            "rollout/gen_seconds": t_gen,
            "rollout/reward_seconds": t_reward,
            "rollout/gen_tokens_per_s": float(lengths.sum()) / max(t_gen, 1e-9),
            "rollout/reward_errors": float(counts["errors"]),
            "rollout/reward_timeouts": float(counts["timeouts"]),
            "rollout/phase": float(req.phase),
            "rollout/multi_version_frac": sum(len(set(r.versions_trained())) > 1 for r in rows) / max(len(rows), 1),
        }
        if c.overlong is not None:
            stats.update({"rollout/overlong_frac": float((penalty < 0).float().mean()),
                          "rollout/overlong_penalty": float(penalty.mean())})
        stats.update(self.samples.stats(groups, env_counters))
        if c.filter_groups is not None:                     # a round: the data module assembles the phase
            return PhaseResult(req.phase, [], counts, t_gen, round=req.round, stats=stats,
                               groups=[rows[g * n:(g + 1) * n] for g in range(len(groups))], keep=signal.tolist())
        batches = phase_batches(rows, req.phase, stats, seed=c.seed, steps=c.steps_per_rollout, pad_id=self.pad_id,
                                sampling=c.sampling, engine_dtype=c.engine.exact_dtype(), max_staleness=c.max_staleness)
        return PhaseResult(req.phase, batches, counts, t_gen)

    def evaluate(self, req: EvalRequest) -> EvalResult:
        """`req.n` samples per held-out prompt with `req.sampling` (or the training settings): the reward and the
        length of each, `[P, n]`."""
        return self.score_eval(req, *self.sample_eval(req))

    @torch.no_grad()
    def sample_eval(self, req: EvalRequest) -> tuple[list[str], list[int]]:
        if not req.prompts:                      # a rank's empty share of the held-out set: no engine call
            return [], []
        groups = self.engine.generate(req.prompts, req.n, req.sampling or self.config.sampling, call_seed=-1,
                                      prompt_keys=req.keys)
        return ([self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for g in groups for s in g],
                [len(s.token_ids) for g in groups for s in g])

    def score_eval(self, req: EvalRequest, texts: list[str], lengths: list[int]) -> EvalResult:
        rewards = self.scorer(texts, repeat(req.answers, req.n),
                              repeat(req.prompt_texts or [""] * len(req.answers), req.n),
                              repeat(row_columns(req.columns, len(req.answers)), req.n),
                              repeat(req.conversations or [None] * len(req.answers), req.n))
        return EvalResult(reward=torch.tensor(rewards, dtype=torch.float32).view(-1, req.n),
                          length=torch.tensor(lengths, dtype=torch.float32).view(-1, req.n))

    def close(self) -> None:
        """Close the scorer, the samples' episode runner and the engine (which removes what it wrote, e.g.
        vLLM's adapter folders). Every executor ends here: InlineExecutor.close (sync), the worker process's
        exit (async)."""
        self.scorer.close()
        self.samples.close()
        self.engine.close()


def phase_batches(rows: list[Row], phase: int, stats: dict, *, seed: int, steps: int, pad_id: int,
                  sampling: SamplingConfig, engine_dtype: str | None, max_staleness: int) -> list[RolloutBatch]:
    """A phase's rows as its `steps` batches: shuffled by (seed, phase), so the same in sync and async, and split
    evenly, each carrying the phase's statistics."""
    rows = list(rows)
    random.Random(derive_seed(seed, phase)).shuffle(rows)
    chunks = [rows[i * len(rows) // steps:(i + 1) * len(rows) // steps] for i in range(steps)]
    return [collate(chunk, pad_id, sampling=sampling, engine_dtype=engine_dtype, stats=dict(stats), phase=phase, index=i,
                    max_staleness=max_staleness) for i, chunk in enumerate(chunks)]


def pad_token_id(tokenizer) -> int:
    """The id rows are padded with: the tokenizer's pad token, else its eos."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

