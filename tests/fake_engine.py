"""A fake rollout engine for scheduling tests: no model, a fixed latency per generate call.

Each completion is `length` tokens; every token's behaviour logprob is -w, where w is the value of the
weight tensor "w" last loaded, so a test can check which weights generated a row (it pushes w =
version). The engine records nothing else; it runs in the worker process like a real engine.
`hang_on_call` makes one generate call never return (a hung engine).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from lit_ess.engines import EngineConfig, RolloutEngine
from lit_ess.sampling import Completion


@dataclass
class FakeConfig(EngineConfig):
    latency: float = 0.05          # seconds per generate call
    length: int = 3
    hang_on_call: int = -1         # the generate call (0, 1, ...) that never returns; -1: none

    def build(self, model_path: str) -> "FakeEngine":
        return FakeEngine(self)


class FakeEngine(RolloutEngine):
    def __init__(self, c: FakeConfig):
        self.c, self.version, self.w, self.calls = c, 0, 0.0, 0

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        self.calls += 1
        while self.calls - 1 == self.c.hang_on_call:
            time.sleep(1.0)
        time.sleep(self.c.latency)
        return [[Completion([40 + (i + j + call_seed) % 10] * self.c.length, [-self.w] * self.c.length, "length",
                            self.version) for j in range(n)] for i in range(len(prompts))]

    def load_weights(self, named_tensors, version):
        self.w = float(dict(named_tensors)["w"])
        self.version = version
