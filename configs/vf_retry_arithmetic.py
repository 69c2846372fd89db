"""A `verifiers` environment written as verifiers' users write one (its v1 API: a Taskset of Tasks with an
`@vf.reward` rubric, and an Env whose `run()` holds a multi-turn exchange), for configs/demo_verifiers.yaml:
retry with feedback on 2-digit addition, the task of configs/demo_multiturn.yaml.

    user: 37+85=   assistant: 121   user: wrong, 37+85=   assistant: 122          rubric: solved = 1/2

verifiers 0.4.0 ships no environment that runs here without a network or containers (its built-in tasksets
drive Harbor containers, NeMo Gym servers, TextArena with downloaded word lists, and OpenEnv through the
`openenv` >= 0.4.1 client), so the demo brings this one; lit_ess.envs.verifiers_env runs any verifiers taskset
the same way. verifiers finds a taskset by its id as a top-level module (an installed environment package,
or this file: the CLI puts the config's folder on sys.path, as for a reward module beside the config):
`taskset: {id: vf_retry_arithmetic, size: 1000}`.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

FEEDBACK = "wrong"


class RetryData(vf.TaskData):
    answer: str
    """The sum, as the policy should write it."""


class RetryTask(vf.Task[RetryData]):
    @vf.reward
    async def solved(self, task: RetryData, trace: vf.Trace) -> float:
        """1 / (the number of the first right reply), 0 when no reply is right."""
        for tries, reply in enumerate(trace.assistant_messages, 1):
            if (reply.content or "").strip() == task.answer:
                return 1.0 / tries
        return 0.0


class RetryConfig(vf.TasksetConfig):
    size: int = 1000
    """Tasks in the taskset."""
    seed: int = 0
    """Draws the sums."""


class RetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_tries: int = 3
    """Replies the player may give."""


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(self.config.max_tries - 1):
                if segment.terminated or segment.last_reply == task.data.answer:
                    break
                segment = await interaction.turn(f"{FEEDBACK}, {task.data.prompt}")


class RetryTaskset(vf.Taskset[RetryTask, RetryConfig]):
    def load(self) -> Iterator[RetryTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            a, b = rng.randrange(100), rng.randrange(100)
            yield RetryTask(RetryData(name=f"sum#{i}", prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["RetryConfig", "RetryData", "RetryEnv", "RetryEnvConfig", "RetryTask", "RetryTaskset"]
