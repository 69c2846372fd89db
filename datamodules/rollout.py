"""RolloutDataModule: a stream of optimizer-step batches read from a versioned rollout buffer.

    prompts (this module: cursor, order)  ->  executor (engine, rewards, advantages)  ->  RolloutBuffer
        -> one RolloutBatch per optimizer step  ->  PolicyModule.training_step

One schedule, whatever runs the engine: a phase is submitted as soon as the newest weights may
generate it (the buffer's admission rule, lit_ess/rollout/buffer.py: no row is ever trained more
than `schedule.max_staleness` steps after the weights that sampled it), and the trainer takes one batch per
step. The executor (lit_ess/rollout/executor.py, one protocol: start, load_weights, submit, poll)
decides where the work runs:
* `schedule.mode: sync`: in the trainer's process, at submission (generation blocks training). With the
  default S = batch.steps_per_rollout - 1 a phase is admitted when the trainer needs it, with the weights of
  the step that trains its first batch: exactly on-policy for one step per rollout. A larger S
  generates ahead with older weights: staleness that is exactly reproducible.
* `schedule.mode: async`: in a worker process that generates while the trainer trains, as far ahead as S allows.

The train loader has a known length (`batch.steps_per_epoch` batches), so Lightning never prefetches: the
batch of step s is assembled after step s-1's update and weight push. Each item pulls the next batch
from the buffer, so data is never reused, and no Trainer flag is needed. The loaders are iterable
datasets with a length, so Lightning does not wrap them in a DistributedSampler: this module shards.

Data parallel (W ranks): every rank draws the same `batch.prompts_per_rollout` prompts of a phase (same
order, same cursor) and keeps positions `rank, rank + W, ...`; request seeds use a prompt's position
in the whole phase. So W ranks sample, between them, exactly the rows one rank would (vllm engine: a
seed per request; hf seeds per chunk), each group stays whole on one rank (its advantages need it),
and the ranks' batches never overlap. Every rank plans and submits its own share; async on W ranks has
two placements (`schedule.placement`), which the executor carries (lit_ess/rollout/placement.py `build_executor`):
* `colocated` (default): every rank's worker process has its own engine (sharing the trainer's GPUs, or
  CPU cores);
* `dedicated`: every rank's worker process sends its share to vLLM servers that generation has to itself
  (engine: VLLMServerConfig; servers by URL, or one rank 0 launches on `engine.worker_devices`); rank 0
  pushes the weights, the other ranks' engines wait until the servers carry them.
The ranks wait for their data together (lit_ess/rollout/ranks.py `in_step`): a worker that fails stops
every rank in the same round, with its error. Whether new weights are needed is decided together too
(`wants_weights` is true on every rank when it is on one), so every rank enters the weight gather
(FSDP2) at the same steps, whatever the timing of each rank's worker.

This module is the trainer's data side (lit_ess.data.RolloutData), handed to the module in `setup`
(`attach_rollouts`): a phase's waiting batches for proximal scoring, and the weights. After each step
lit_ess.callbacks.WeightSync asks `wants_weights(version)` (the same answer on every rank) and then calls
`push_weights(tensors, version)` on every rank: only when the engine will generate next (with k steps per
rollout, once per phase); the executor hands them to the engine. Without them the first rollout that would need newer weights fails
with an error that names the callback.

`state_dict` holds the prompt cursor and order, the buffer (batches not yet trained, with the
version of each row), and the requests in flight, which are regenerated after a resume. With DAPO's
dynamic sampling (`dynamic_sampling`, lit_ess/rollout/dapo.py) a phase is generated in rounds, each an
ordinary request drawn from the same cursor; the groups a phase has kept so far are in the state too.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_ess.advantages import Advantage, resolve_advantage
from lit_ess.batch import EvalResult, RolloutBatch
from lit_ess.data import RolloutConsumer
from lit_ess.engines import EngineConfig, VLLMConfig, VLLMServerConfig
from lit_ess.envs import EnvConfig
from lit_ess.rewards import ModelReward, Reward, RewardScorer, as_rewards
from lit_ess.engines.base import prompt_budget
from lit_ess.knobs import check
from lit_ess.rollout import (EvalRequest, PhaseResult, RolloutBuffer, RolloutExecutor, RolloutRequest, Ranks, TorchRanks,
                             WorkerConfig, Placement, build_executor, in_step)
from lit_ess.sampling import SamplingConfig
from lit_ess.rollout.dapo import DynamicSampling, OverlongPenalty, PhaseFill
from lit_ess.rollout.worker import pad_token_id, phase_batches

from lit_ess.chat import ChatFormat, Prompt, check_format, prompt_text

from .prompts import Arithmetic, Example, PromptOrder, PromptSource, check_chat, encode_prompt
from .settings import BatchShape, RewardLimits, Schedule, Validation

MAX_PHASES_IN_FLIGHT = 2


class _StepDataset(IterableDataset):
    """An epoch of `steps_per_epoch` batches, each pulled from the stream when the trainer asks for it.
    After a mid-epoch resume it yields only the epoch's remaining batches while reporting the full
    length, so Lightning's restored batch counter stays right."""

    def __init__(self, dm: "RolloutDataModule"):
        self.dm = dm

    def __len__(self) -> int:
        return self.dm.batch.steps_per_epoch

    def __iter__(self):
        start, self.dm.resume_offset = self.dm.resume_offset, 0
        for _ in range(start, self.dm.batch.steps_per_epoch):
            yield self.dm.next_batch(self.dm.trainer_step())


class _ValDataset(IterableDataset):
    """This rank's held-out chunks, each sampled and scored by the engine when it is read."""

    def __init__(self, dm: "RolloutDataModule", chunks: list[list[tuple[str, str]]]):
        self.dm, self.chunks = dm, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self):
        for chunk in self.chunks:
            yield self.dm.evaluate(chunk)


def _identity(x):
    return x


def val_chunks(examples: list, size: int, rank: int, world: int) -> list[list]:
    """This rank's share of the held-out examples (positions rank, rank + W, ...) in batches of at
    most `size`. Every rank gets the same number of batches, at least one, some possibly empty:
    a rank that skipped validation would leave the others waiting in its collectives."""
    mine = examples[rank::world]
    count = max(1, math.ceil(len(examples) / (world * size)))
    per = math.ceil(len(mine) / count) if mine else 0
    return [mine[i * per:(i + 1) * per] for i in range(count)]


class RolloutDataModule(L.LightningDataModule):
    """One rollout batch per optimizer step, from a versioned buffer of generated phases.

    Args:
        model_path: the policy's Hugging Face folder (linked from the model by the CLI).
        source: where prompts come from (default: 2-digit addition).
        engine: the rollout engine's typed config: lit_ess.engines.VLLMConfig (vLLM, the default) or
            lit_ess.engines.HFConfig (transformers generate); e.g. dtype: bfloat16 for a precision
            mismatch, behavior_logprobs: raw for the authors' definition of pi_b.
        sampling: temperature, top_p, top_k, max_new_tokens, stop, seed. With a seed (default 0) every
            request gets its own derived seed, so rollouts are reproducible and resumable.
        chat: how prompts are rendered (lit_ess.chat.ChatFormat): with the model's chat template and its
            generation prompt (default; a text prompt is one user message), a `system_prompt` for prompts
            without a system message, `chat_template_kwargs` for the template (e.g. {enable_thinking:
            false}), or `use_template: false` for plain-text prompts. The same for source and validation.source.
            With `env`, the environment renders its own prompts: the default only.
        reward: "exact_match", "gsm8k", "math_verify", "module:function" or "module.function" (a module
            beside the config or in the working directory), or a list of lit_ess.rewards.Reward
            ({fn, weight, name}): the total is their weighted sum, each one logged as train/reward/NAME.
            A model scores too, alone or as a Reward's fn, by class_path: lit_ess.reward_model.RewardModel
            (a sequence-classification checkpoint) or lit_ess.engines.LLMJudge (an LLM judge through
            vLLM's OpenAI API). A reward takes by parameter name `prompt`, `completion`, `answer` and any column of the
            dataset row (checked at start against the source's columns); one declared with
            @lit_ess.rewards.batched scores the phase at once (lists in, a list out); either may be
            `async def` (docs/rewards.md). With `env`, the environment gives the training rewards and
            `reward` scores the held-out prompts (one turn each).
        env: multi-turn rollouts (lit_ess.envs.EnvConfig): each sample is an episode of this environment
            (e.g. {env: {class_path: lit_ess.envs.RetryArithmetic, init_args: {max_tries: 3}}, max_turns: 3}) in which the policy and
            the environment take turns, token in, token out; the environment's tokens are context with
            completion mask 0 and no behaviour logprob, a row's version is its episode's oldest turn's.
            Environment failures count as failing rewards (reward_limits.max_error_rate). None (default): one
            completion per sample, scored by `reward`.
        reward_limits: how long a reward may take, how often it may fail, and in which process it runs
            (datamodules/settings.py RewardLimits: timeout, max_error_rate, in_worker).
        batch: the shape of a phase (BatchShape: prompts_per_rollout,
            samples_per_prompt, steps_per_rollout, steps_per_epoch).
        schedule: sync or async generation, placement, max_staleness, worker_timeout (Schedule).
        advantage: the advantage estimator, rewards [G, n] -> advantages [G, n] (lit_ess.advantages): by class
            (class_path lit_ess.advantages.GroupMean with normalize_std and eps, RLOO, or a subclass of
            lit_ess.advantages.Advantage of your own) or by name: "zscore" (GroupMean(): GRPO), "mean"
            (GroupMean(normalize_std=False): Dr.GRPO), "rloo" (RLOO(): leave-one-out).
        drop_degenerate: drop groups whose rewards are all equal (they carry zero advantage). When too
            few rows remain for `steps_per_rollout` steps, dropped groups are restored (in order) until
            every step has a row; `rollout/dropped_groups` counts the groups really dropped. The phase is
            not refilled: dynamic_sampling does that (and drops groups itself: set one of the two).
        dynamic_sampling: DAPO's dynamic sampling (lit_ess.rollout.dapo.DynamicSampling): {enable: true}
            drops the groups whose rewards are all equal and generates further prompts, in rounds of
            prompts_per_rollout, until the phase holds prompts_per_rollout groups with a signal or
            `max_rounds` rounds ran (then it is trained short, `rollout/batch_short`). Counted per phase in
            `rollout/refill_rounds`, `rollout/dropped_groups`, `rollout/surplus_groups`. One data-parallel
            rank. Default: off.
        overlong: DAPO's soft overlong punishment (lit_ess.rollout.dapo.OverlongPenalty): {enable: true}
            adds 0 to -factor to the training reward of a completion longer than max_length - buffer tokens
            (max_length: sampling.max_new_tokens unless set), before the group advantages; logged as
            `rollout/overlong_frac` and `rollout/overlong_penalty`. Default: off.
        max_prompt_tokens: longer prompts are skipped and counted (`rollout/skipped_long_prompts`); >= 1. With
            `env`, an episode whose first observation (the environment's reset) is longer is not played: its
            row holds the observation cut to this many tokens and no turn (`rollout/truncated_prompts`).
            None = the room the engine's model length leaves (engine.max_model_len, else the model's
            max_position_embeddings, minus sampling.max_new_tokens); a value whose sum with
            max_new_tokens exceeds that length is refused at start.
        seed: prompt order and row shuffling (an integer >= 0).
        validation: held-out prompts and how they are sampled (Validation: source, prompts, samples,
            sampling).
    """

    def __init__(
        self,
        model_path: str = "",
        source: PromptSource | None = None,
        engine: EngineConfig = VLLMConfig(),
        sampling: SamplingConfig = SamplingConfig(seed=0),
        chat: ChatFormat = ChatFormat(),
        reward: str | ModelReward | list[Reward] = "exact_match",
        reward_limits: RewardLimits = RewardLimits(),
        batch: BatchShape = BatchShape(),
        schedule: Schedule = Schedule(),
        advantage: Literal["zscore", "mean", "rloo"] | Advantage = "zscore",
        drop_degenerate: bool = False,
        dynamic_sampling: DynamicSampling = DynamicSampling(),
        overlong: OverlongPenalty = OverlongPenalty(),
        max_prompt_tokens: int | None = None,
        seed: int = 0,
        validation: Validation = Validation(),
        env: EnvConfig | None = None,
    ):
        super().__init__()
        for name, group, kind in (("batch", batch, BatchShape), ("schedule", schedule, Schedule),
                                  ("reward_limits", reward_limits, RewardLimits), ("validation", validation, Validation)):
            if not isinstance(group, kind):
                raise ValueError(f"data.{name} must be a {kind.__module__}.{kind.__name__}, got {group!r}")
        check("data.max_prompt_tokens", max_prompt_tokens, ge=1, integer=True, null=True)
        check("data.seed", seed, ge=0, integer=True)
        self.source = source if source is not None else Arithmetic()
        reward = as_rewards(reward) if isinstance(reward, (list, ModelReward)) else reward
        for src in (self.source, validation.source):     # a typo, a non-function or an unknown column fails now
            if src is not None:
                RewardScorer(reward, columns=common_columns(src.examples), in_worker=reward_limits.in_worker).close()
        if schedule.placement == "dedicated" and not isinstance(engine, VLLMServerConfig):
            raise ValueError(f"data.schedule.placement: dedicated generates on vLLM servers shared by every rank, not with "
                             f"{type(engine).__name__}: set data.engine to lit_ess.engines.VLLMServerConfig (urls, or "
                             f"none: rank 0 launches one on engine.worker_devices)")
        if schedule.mode == "sync" and isinstance(engine, EngineConfig) and engine.updates_in_flight():
            raise ValueError("engine.weight_update: in_flight updates the weights of requests being generated, "
                             "which happens only in mode: async (sync generates between steps): set "
                             "data.schedule.mode: async, or engine.weight_update: drain")
        if env is not None and not isinstance(env, EnvConfig):
            raise ValueError(f"env must be an environment config (lit_ess.envs.EnvConfig) or null, got {env!r}")
        check_format(chat)
        if not isinstance(dynamic_sampling, DynamicSampling):
            raise ValueError(f"dynamic_sampling must be a lit_ess.rollout.dapo.DynamicSampling, got {dynamic_sampling!r}")
        if not isinstance(overlong, OverlongPenalty):
            raise ValueError(f"overlong must be a lit_ess.rollout.dapo.OverlongPenalty, got {overlong!r}")
        if dynamic_sampling.enable and drop_degenerate:
            raise ValueError("drop_degenerate and dynamic_sampling.enable: dynamic sampling drops the groups without a "
                             "signal itself and refills the phase; set one of the two")
        if overlong.enable and env is not None and overlong.max_length is None:
            raise ValueError("overlong.max_length: set it with env (an episode's policy tokens add up over its turns; "
                             "sampling.max_new_tokens caps one turn)")
        if not isinstance(engine, EngineConfig):
            raise ValueError(f"engine must be an engine config (lit_ess.engines.VLLMConfig or HFConfig), got {engine!r}")
        self.model_path = model_path
        if env is not None and (chat != ChatFormat() or any(isinstance(e.prompt, list) for e in self.source.examples)):
            raise ValueError("env: an environment starts its episodes from text prompts and renders them itself; "
                             "chat prompts and data.chat settings apply to single-turn rollouts (env: null)")
        self.engine_config, self.sampling, self.chat = engine, sampling, chat
        self.reward_name, self.reward_limits, self.env = reward, reward_limits, env
        steps = batch.steps_per_rollout         # None resolved: one phase per epoch, the synchronous lag
        self.batch = replace(batch, steps_per_epoch=steps if batch.steps_per_epoch is None else batch.steps_per_epoch)
        self.schedule = replace(schedule, max_staleness=steps - 1 if schedule.max_staleness is None
                                else schedule.max_staleness)
        self.advantage, self.drop_degenerate = resolve_advantage(advantage), drop_degenerate
        self.dynamic_sampling = dynamic_sampling
        self.overlong = overlong.resolved(sampling.max_new_tokens) if overlong.enable else overlong
        if overlong.enable and env is None and self.overlong.max_length - self.overlong.buffer >= sampling.max_new_tokens:
            raise ValueError(f"overlong: the penalty starts past {self.overlong.max_length - self.overlong.buffer} tokens "
                             f"(max_length {self.overlong.max_length} - buffer {self.overlong.buffer}), which no completion of "
                             f"sampling.max_new_tokens={sampling.max_new_tokens} reaches: lower overlong.max_length")
        self.max_prompt_tokens, self.seed = max_prompt_tokens, seed
        self.prompt_limit = max_prompt_tokens       # the longest prompt sampled; set in setup() (prompt_budget)
        self.validation = validation
        self.val_sampling = (_with_changes(sampling, validation.sampling, "data.validation.sampling")
                             if validation.sampling else None)      # the held-out SamplingConfig, None = `sampling`
        self.buffer = RolloutBuffer(steps, self.schedule.max_staleness)   # validates max_staleness
        # Logged hyper-parameters (merged with the model's): every mismatch knob as a plain value, so
        # the checkpoint holds no prompt-source or config objects. model_path is the model's.
        self.save_hyperparameters({
            "engine": engine.hparams(), "sampling": asdict(sampling), "chat": asdict(chat),
            "batch": asdict(self.batch), "schedule": asdict(self.schedule), "advantage": self.advantage.hparams(),
            "reward": reward if isinstance(reward, str) else [reward_hparams(r) for r in reward],
            "drop_degenerate": drop_degenerate, "dynamic_sampling": asdict(dynamic_sampling),
            "overlong": asdict(self.overlong), "seed": seed, "source": type(self.source).__name__,
            "reward_limits": asdict(reward_limits),
            "validation": {"source": type(validation.source).__name__ if validation.source is not None else None,
                           "prompts": validation.prompts, "samples": validation.samples,
                           "sampling": asdict(self.val_sampling) if self.val_sampling is not None else None},
            "env": env.hparams() if env is not None else None})
        self.executor: RolloutExecutor | None = None
        self.ranks: Ranks | None = None                    # set in setup() from the trainer (a test may set it)
        self.tokenizer = None
        # resumable state
        self.prompt_order = PromptOrder(len(self.source), seed)
        self.next_plan = 0                                  # next phase whose prompts are drawn
        self.requests: dict[int, RolloutRequest] = {}      # planned and not yet in the buffer, by phase (with
                                                           # dynamic sampling: the phase's round to generate)
        self.fills: dict[int, PhaseFill] = {}              # dynamic sampling: the rounds of phases not yet full
        self.submitted: dict[int, int] = {}                # request id -> phase, not yet in the buffer
        self.evaluated: dict[int, EvalResult] = {}         # request id -> held-out results not yet read
        self.skipped_long_prompts = 0
        self.reward_counters: dict = {}
        self.resume_offset = 0
        self.wait_seconds, self.t_start = 0.0, None
        self.rank, self.world = 0, 1                       # data-parallel position, set in setup()
        self.place: Placement | None = None               # where rollouts run (mode, placement in force, world), set in setup()

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if isinstance(module, RolloutConsumer):        # PolicyModule: this module is its data side (RolloutData)
            module.attach_rollouts(self)
        if self.executor is not None:
            return
        if not self.model_path:
            raise ValueError("RolloutDataModule.model_path is empty: set model.model_path (the CLI links it)")
        if stage == "validate" and self.validation.source is None:
            raise ValueError("validate needs held-out prompts: set data.validation.source (e.g. class_path "
                             "lit_ess.datamodules.Arithmetic with split: test, or HFPrompts)")
        from transformers import AutoTokenizer

        if self.ranks is None:
            self.ranks = TorchRanks(*self._rank_and_world())
        self.rank, self.world = self.ranks.rank, self.ranks.world
        if stage == "fit" and self.batch.prompts_per_rollout % self.world:
            raise ValueError(f"data.batch.prompts_per_rollout={self.batch.prompts_per_rollout} is not a multiple of the {self.world} "
                             f"data-parallel ranks: each rank generates whole groups of an equal share")
        if stage == "fit" and self.dynamic_sampling.enable and self.world > 1:
            raise ValueError(f"dynamic_sampling.enable on {self.world} data-parallel ranks: a refill draws prompts from "
                             f"the prompt order every rank shares, which needs the ranks to agree on every refill; "
                             f"run it on one rank (devices x nodes = 1)")
        rows = self.batch.prompts_per_rollout // self.world * self.batch.samples_per_prompt
        if stage == "fit" and rows < self.batch.steps_per_rollout:
            raise ValueError(f"each of the {self.world} ranks gets {rows} rows per rollout "
                             f"(prompts_per_rollout / ranks x samples_per_prompt), fewer than data.batch.steps_per_rollout="
                             f"{self.batch.steps_per_rollout}: every step needs a row on every rank")
        limit = self.engine_config.model_len(self.model_path)          # before the engine starts
        budget = self.env.max_episode_tokens if self.env is not None else None
        if budget is not None and limit is not None and budget > limit[0]:
            raise ValueError(f"env.max_episode_tokens={budget} exceeds the engine's model length {limit[0]} ({limit[1]})")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        check_chat(self.tokenizer, self.chat, [self.source, self.validation.source])
        self.prompt_limit = prompt_budget(self.max_prompt_tokens, self.sampling.max_new_tokens, limit)
        self.place = Placement.of(self.schedule.mode, self.schedule.placement, self.world)
        self.executor = build_executor(self._worker_config(), self.place, self.ranks, self.schedule.worker_timeout)
        self.executor.start()
        if self.place.shares_servers(self.engine_config):
            # rank 0's engine labels the servers "-1" as it starts: no rank asks them for weights before that
            in_step(self.ranks, lambda: self.executor.ready() or None)

    def _worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model_path=self.model_path, engine=self.engine_config, sampling=self.sampling, reward=self.reward_name,
            reward_timeout=self.reward_limits.timeout, samples_per_prompt=self.batch.samples_per_prompt,
            steps_per_rollout=self.batch.steps_per_rollout, advantage=self.advantage, drop_degenerate=self.drop_degenerate,
            seed=self.seed, max_staleness=self.schedule.max_staleness, reward_counters=dict(self.reward_counters),
            max_reward_error_rate=self.reward_limits.max_error_rate, reward_in_worker=self.reward_limits.in_worker, env=self.env,
            prompt_limit=self.prompt_limit, overlong=self.overlong if self.overlong.enable else None,
            filter_groups=self.dynamic_sampling.metric if self.dynamic_sampling.enable else None)

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def teardown(self, stage: str) -> None:
        if self.executor is not None:            # an interrupted run (Ctrl-C, SIGTERM) stops its worker at once
            self.executor.close(grace=1.0 if self.trainer is not None and self.trainer.interrupted else 60.0)
            self.executor = None
        self.submitted = {}          # their requests stay in self.requests and are generated again

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepDataset(self), batch_size=None, collate_fn=_identity, num_workers=0)

    def val_dataloader(self):
        if self.validation.source is None:
            return []
        ex = [(i, e.prompt, e.answer, e.columns) for i, e in enumerate(self.validation.source.examples)]
        return DataLoader(_ValDataset(self, val_chunks(ex, self.validation.prompts, self.rank, self.world)), batch_size=None,
                          collate_fn=_identity)

    # ------------------------------------------------------------------ weights (lit_ess.callbacks.WeightSync)
    def wants_weights(self, version: int) -> bool:
        """True when the engine will generate before the trainer's next step, so new weights are needed
        (an engine that takes them in flight: also while a phase is being generated). Called on every
        rank at the same point; true on every rank when it is true on one."""
        def mine() -> tuple[bool]:
            self._collect(timeout=0.0)
            return (self.executor.version != version                         # (e.g. after a skipped step: it
                    and (self._admissible(version, step=version) is not None   # has these weights already)
                         or (self.executor.updates_in_flight and bool(self.submitted))),)
        return any(w for (w,) in in_step(self.ranks, mine, share=True))

    def push_weights(self, named_tensors, version: int) -> None:
        """Hand the policy's weights (Hugging Face names) of optimizer step `version` to the engine.
        (The phases they make admissible start at the trainer's next request for data, so a stand-alone
        `lit-ess validate` starts none.)"""
        self.executor.load_weights(named_tensors, version)

    def _start_admissible(self, step: int) -> None:
        """Submit every phase the newest pushed weights may generate (up to the in-flight cap)."""
        while (p := self._admissible(self.executor.version, step)) is not None:
            self.submitted[self.executor.submit(self._request(p))] = p

    def _admissible(self, version: int, step: int) -> int | None:
        """The next phase to start, if weights of `version` may
        generate it while the trainer's next step is `step`, and fewer than MAX_PHASES_IN_FLIGHT phases are
        being generated."""
        p = min((q for q in self.requests if q not in self.submitted.values()), default=self.next_plan)
        if (len(self.submitted) >= MAX_PHASES_IN_FLIGHT or version < 0
                or self.buffer.need(p, step) > version):
            return None
        return p

    def waiting_batches(self, phase: int) -> list[RolloutBatch]:
        """The batches of `phase` still in the buffer, not yet trained (PolicyModule.score_phase)."""
        return self.buffer.waiting(phase)

    # ------------------------------------------------------------------ the stream
    def next_batch(self, step: int) -> RolloutBatch:
        """The batch of optimizer step `step` (blocks until every rank has its batch)."""
        if self.t_start is None:
            self.t_start = time.perf_counter()
        t0 = time.perf_counter()

        def attempt() -> RolloutBatch | None:
            self._start_admissible(step)
            if (batch := self.buffer.take(step)) is None:
                self._start_admissible(step)       # a batch the filter dropped whole may admit the next phase
                self._wait(step)
                batch = self.buffer.take(step)
            return batch
        batch = in_step(self.ranks, attempt)
        self.wait_seconds += time.perf_counter() - t0
        elapsed = max(time.perf_counter() - self.t_start, 1e-9)
        ex = self.executor
        batch.stats = {
            **batch.stats, "rollout/skipped_long_prompts": float(self.skipped_long_prompts),
            "data/skipped_rows": float(self.source.skipped), "rollout/stale_dropped": float(self.buffer.stale_dropped),
            "rollout/buffer_size": float(self.buffer.rows()), "perf/trainer_wait_frac": self.wait_seconds / elapsed,
            "perf/worker_idle_frac": ex.idle_seconds / max(ex.idle_seconds + ex.busy_seconds, 1e-9),
            "rollout/phases_in_flight": float(len(self.submitted))}
        return batch

    def _wait(self, step: int) -> None:
        """Wait (about a second at most) for the phase being served to reach the buffer (one that was never
        submitted is an error: the weights never came)."""
        p = self.buffer.next_phase
        if p not in self.submitted.values():
            raise RuntimeError(
                f"no rollout is in flight for phase {p} at step {step}: it needs weights of step >= "
                f"{self.buffer.need(p, step)}, the engine holds step {self.executor.version}'s. Add "
                f"lit_ess.callbacks.WeightSync to the Trainer's callbacks (it pushes weights before each rollout)")
        self._collect(timeout=1.0)

    def _collect(self, timeout: float) -> None:
        """Move finished requests from the executor: phases into the buffer, held-out results aside."""
        self._take(self.executor.poll(timeout=timeout))

    def _take(self, results: list[tuple[int, PhaseResult | EvalResult]]) -> None:
        for rid, result in results:
            self.submitted.pop(rid, None)
            if isinstance(result, PhaseResult):
                self._add(result)
            else:
                self.evaluated[rid] = result

    def _add(self, result: PhaseResult) -> None:
        if result.reward_counters:
            self.reward_counters = result.reward_counters
        if result.groups is not None:               # dynamic sampling: one round of the phase
            self._add_round(result)
            return
        self.requests.pop(result.phase, None)
        self.buffer.put(result.phase, result.batches)

    def _add_round(self, result: PhaseResult) -> None:
        """Keep a round's groups with a signal; then refill the phase with its next round (submitted at once, so
        the phase is never without a request in flight), or, full or out of rounds, put it in the buffer."""
        p = result.phase
        fill = self.fills.setdefault(p, PhaseFill(p, self.batch.prompts_per_rollout // self.world,
                                                  self.dynamic_sampling.max_rounds, self.batch.steps_per_rollout))
        if result.round != len(fill.rounds):
            raise RuntimeError(f"round {result.round} of rollout phase {p} arrived, expected round {len(fill.rounds)}")
        fill.add(result.groups, result.keep, result.stats)
        if not fill.done:
            self.requests[p] = self._refill(p, len(fill.rounds))
            self.submitted[self.executor.submit(self.requests[p])] = p
            return
        rows, stats = fill.rows()
        del self.fills[p]
        self.requests.pop(p, None)
        self.buffer.put(p, phase_batches(rows, p, stats, seed=self.seed, steps=self.batch.steps_per_rollout,
                                         pad_id=pad_token_id(self.tokenizer), sampling=self.sampling,
                                         engine_dtype=self.engine_config.exact_dtype(), max_staleness=self.schedule.max_staleness))

    def trainer_step(self) -> int:
        """The optimizer step the trainer takes next (the global step)."""
        if self.trainer is None:
            raise RuntimeError("RolloutDataModule.train_dataloader is read by a Lightning Trainer; without one, "
                               "call next_batch(step)")
        return self.trainer.global_step

    # ------------------------------------------------------------------ prompts
    def _request(self, phase: int) -> RolloutRequest:
        """This rank's request for `phase`, kept until the phase is in the buffer: the phase's prompts are
        drawn once (cursor order, the same on every rank), this rank's share is positions rank, rank + W, ..."""
        if phase not in self.requests:
            if phase != self.next_plan:
                raise RuntimeError(f"phase {phase} requested out of order (next is {self.next_plan})")
            idx, examples, prompts = self._next_prompts(self.batch.prompts_per_rollout)
            mine = range(self.rank, len(idx), self.world)
            self.requests[phase] = RolloutRequest(phase, [idx[i] for i in mine], [prompts[i] for i in mine],
                                                  [prompt_text(examples[i].prompt) for i in mine],
                                                  [examples[i].answer for i in mine], prompt_keys=list(mine),
                                                  columns=[examples[i].columns for i in mine],
                                                  conversations=[conversation(examples[i].prompt) for i in mine])
            self.next_plan += 1
        return self.requests[phase]

    def _refill(self, phase: int, round: int) -> RolloutRequest:
        """Round `round` of `phase` (dynamic sampling): prompts_per_rollout further prompts from the cursor, as
        the phase's first round drew its own; their request seeds (prompt keys) follow the earlier rounds'."""
        idx, examples, prompts = self._next_prompts(self.batch.prompts_per_rollout)
        mine = range(self.rank, len(idx), self.world)
        return RolloutRequest(phase, [idx[i] for i in mine], [prompts[i] for i in mine],
                              [prompt_text(examples[i].prompt) for i in mine], [examples[i].answer for i in mine],
                              prompt_keys=[round * len(idx) + i for i in mine], columns=[examples[i].columns for i in mine],
                              conversations=[conversation(examples[i].prompt) for i in mine], round=round)

    def _next_examples(self, k: int) -> list[tuple[int, Example]]:
        return [(i, self.source.examples[i]) for i in self.prompt_order.take(k)]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.chat)

    def _next_prompts(self, k: int) -> tuple[list[int], list[Example], list[list[int]]]:
        """k examples that fit max_prompt_tokens, with their source indices and token ids; longer ones
        are skipped and counted. Raises only when a streak of skips covers a whole pass over the source
        (2 x its size consecutive draws always contain one full shuffled pass): then no prompt fits."""
        idx, examples, prompts, streak = [], [], [], 0
        while len(examples) < k:
            for i, ex in self._next_examples(k - len(examples)):
                ids = self.encode_prompt(ex.prompt)
                if len(ids) > self.prompt_limit:
                    self.skipped_long_prompts += 1
                    streak += 1
                    if streak >= 2 * len(self.source):
                        raise ValueError(f"every prompt of the source is longer than max_prompt_tokens="
                                         f"{self.prompt_limit} tokens: raise max_prompt_tokens")
                    continue
                streak = 0
                idx.append(i)
                examples.append(ex)
                prompts.append(ids)
        return idx, examples, prompts

    def generate_phase(self) -> list[RolloutBatch]:
        """Generate the next phase with the engine's current weights and return all its batches, as if
        they were trained (for inspection and tests; one rank)."""
        p = self.buffer.next_phase
        self.submitted[self.executor.submit(self._request(p))] = p
        while p not in self.buffer.ready:
            self._collect(timeout=1.0)
        return self.buffer.pop_phase(p)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate(self, examples: list[tuple]) -> EvalResult:
        """`validation.samples` samples per held-out (index, prompt, answer[, columns]) with `val_sampling` (default: the
        training sampling settings): the reward and the length of each, `[P, n]`.
        Every rank calls it equally often (an empty batch keeps a rank in step with the others)."""
        req = EvalRequest([self.encode_prompt(e[1]) for e in examples], [e[2] for e in examples],
                          [e[0] for e in examples], self.validation.samples, self.val_sampling,
                          prompt_texts=[prompt_text(e[1]) for e in examples],
                          columns=[e[3] if len(e) > 3 else {} for e in examples],
                          conversations=[conversation(e[1]) for e in examples])
        rid = self.executor.submit(req)

        def attempt():
            if rid not in self.evaluated:
                self._collect(timeout=1.0)           # phases that arrive meanwhile go to the buffer
            return self.evaluated.pop(rid, None)
        return in_step(self.ranks, attempt)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """The resumable state; with W ranks, every rank's (each holds its own buffer and prompts)."""
        state = self._local_state()
        if self.world == 1:
            return state
        return {"ranks": self.ranks.all_gather(state)}   # every rank saves; Lightning writes rank 0's copy

    def load_state_dict(self, state: dict) -> None:
        """Restore a run to continue it. `lit-ess validate` needs none of this state: it is ignored
        there, so a checkpoint can be evaluated on any number of devices."""
        if self.trainer is not None and self.trainer.state.fn != "fit":
            return
        if "ranks" in state or self.world > 1:
            saved = len(state.get("ranks", [state]))
            if saved != self.world:
                raise ValueError(f"this checkpoint's rollout state was saved by {saved} data-parallel rank(s), this "
                                 f"run has {self.world}: resume with the same number of devices x nodes")
            state = state["ranks"][self.rank]
        self._load_local_state(state)

    def _local_state(self) -> dict:
        return {
            **self.prompt_order.state_dict(), "next_plan": self.next_plan,
            "requests": [asdict(r) for r in self.requests.values()],    # in flight: regenerated after a resume
            "buffer": self.buffer.state_dict(), "skipped_long_prompts": self.skipped_long_prompts,
            "reward_counters": self.reward_counters, "epoch_offset": self.buffer.served % self.batch.steps_per_epoch,
            "fills": [f.state_dict() for f in self.fills.values()],
        }

    def _load_local_state(self, state: dict) -> None:
        if state.get("fills") and not self.dynamic_sampling.enable:
            f = state["fills"][0]
            raise ValueError(f"this checkpoint holds a dynamic-sampling phase in the middle of its fill (phase "
                             f"{f['phase']}: {len(f['rounds'])} round(s), {len(f['kept'])} group(s) kept): resume it with "
                             f"data.dynamic_sampling.enable true, or from a checkpoint taken between phases")
        self.prompt_order.load_state_dict(state)
        self.next_plan = state["next_plan"]
        self.requests = {r["phase"]: RolloutRequest(**r) for r in state["requests"]}
        self.fills = {f["phase"]: PhaseFill.from_state(f) for f in state.get("fills", [])}
        self.submitted = {}
        self.buffer.load_state_dict(state["buffer"])
        self.skipped_long_prompts = state["skipped_long_prompts"]
        self.reward_counters = state["reward_counters"]
        if self.executor is not None:
            self.executor.restore(self.reward_counters)
        self.resume_offset = state["epoch_offset"]


def reward_hparams(r: Reward) -> dict:
    """A Reward as plain values; a model's config with its class name."""
    fn = r.fn if isinstance(r.fn, str) else {"class": type(r.fn).__name__, **asdict(r.fn)}
    return {**asdict(r), "fn": fn}


def conversation(prompt: Prompt) -> list[dict] | None:
    """A chat prompt's messages, as a reward model renders them with its own template; None for a text prompt."""
    return None if isinstance(prompt, str) else list(prompt)


def common_columns(examples: list[Example]) -> list[str]:
    """The columns every example's row has (in the first row's order): those a reward may take by name."""
    if not examples:
        return []
    shared = set(examples[0].columns).intersection(*(e.columns for e in examples[1:]))
    return [c for c in examples[0].columns if c in shared]


def _with_changes(sampling: SamplingConfig, changes: dict, knob: str) -> SamplingConfig:
    """`sampling` with some fields changed; an unknown field is named."""
    unknown = sorted(set(changes) - set(asdict(sampling)))
    if unknown:
        raise ValueError(f"{knob}: {unknown} are not sampling settings; choose from {sorted(asdict(sampling))}")
    return replace(sampling, **changes)

