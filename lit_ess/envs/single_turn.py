"""The one-turn environment: today's prompt -> completion -> reward, as an episode.

`reset` returns the example's prompt as it is (the runner encodes it as every prompt is encoded,
lit_ess.datamodules.prompts.encode_prompt), `step` scores the completion with the reward and ends the
episode. Its episodes sample exactly what the single-turn rollout samples (same engine call, same seeds).
The reward runs in the step's thread, timed by the runner's step_timeout: a reward that RewardScorer
runs in a worker process (math_verify, whose sympy calls cannot be interrupted) would keep a timed-out
thread busy here.
"""
from __future__ import annotations

from lit_ess.rewards import bind

from .base import Action, Environment, Example, Step


class SingleTurn(Environment):
    """Args:
        reward: a built-in reward name (exact_match, gsm8k, math_verify) or 'module:function', one sample
            at a time (it may take prompt, completion, answer and the row's columns by name).
    """

    def __init__(self, reward: str = "exact_match"):
        self.reward = bind(reward)
        if self.reward.batched or self.reward.is_async:
            raise ValueError(f"SingleTurn(reward={reward!r}): an episode scores one completion with a plain function; "
                             f"name it as data.reward instead (batched and async rewards are scored there)")
        self.example = Example("", "")

    def reset(self, example: Example) -> str:
        self.example = example
        return example.prompt

    def step(self, action: Action) -> Step:
        e = self.example
        return Step(reward=self.reward.call(self.reward.kwargs([e.prompt], [action.text], [e.answer], [e.columns])[0]),
                    done=True)
