"""Sampling as every layer sees it: the settings (`SamplingConfig`), one sampled completion
(`Completion`), how a call's samples are seeded (`derive_seed`, `group_seed`, `SEED_SCHEME`), and what
a caller needs of an engine to sample (`Sampler`).

They sit on the ground floor because the batch, the trainer, the environments and the engines all speak
them: the trainer scores tokens with the engine's settings, the environments ask an engine for turns,
and none of them should load the engines (lit_ess/engines) to name a type.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from .knobs import check


@dataclass
class SamplingConfig:
    """Generation settings shared by every engine.

    Args:
        temperature: sampling temperature (> 0); the trainer divides its logits by the same value.
        top_p: nucleus mass (1.0 = off); the trainer applies the same truncation.
        top_k: keep the k most likely tokens (-1 = off).
        max_new_tokens: completion length cap; longer completions finish with reason "length".
        stop: strings that end a completion (the completion keeps the tokens that produced them).
        seed: base seed, an integer >= 0. Each prompt's group gets its own seed derived from (seed, call
            seed, prompt key), its sample j that seed + j (`group_seed`), so the n samples of a group and
            repeated prompts are never copies. None = unseeded.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self):
        check("sampling.temperature", self.temperature, gt=0, hint=": RL needs sampled tokens")
        check("sampling.top_p", self.top_p, gt=0, le=1)
        if self.top_k != -1:
            check("sampling.top_k", self.top_k, ge=1, integer=True, hint="; -1 = off")
        check("sampling.max_new_tokens", self.max_new_tokens, ge=1, integer=True)
        check("sampling.seed", self.seed, ge=0, integer=True, null=True)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]          # behaviour logprob of each sampled token
    finish_reason: str             # "stop" (eos or stop string) or "length"
    version: int                   # policy version that produced it: its oldest token's
    token_versions: list[int] | None = None   # the version that sampled each token (None: all `version`);
                                              # several when the weights changed in flight


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from a tuple of ints; distinct tuples give (practically) distinct seeds."""
    h = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


# How the vLLM engines seed a call's samples, recorded with every experiment run (experiments/run.py):
# "per-group" (this code): one request per prompt with n samples, seeded group_seed(...), vLLM seeding its
# child j with that seed + j; "per-sample" (runs made before 2026-11-27): one request per sample, seeded
# derive_seed(seed, call seed, prompt key, j). Same distribution, other draws.
SEED_SCHEME = "per-group"


def group_seed(seed: int | None, call_seed: int, key: int) -> int | None:
    """The seed of one prompt's group of samples in a call: derive_seed(seed, call seed, prompt key), None
    when sampling is unseeded. Sample j of the group draws with seed + j (vLLM 0.32 seeds child j of a
    request with `n` samples so), in process and on a server alike, so both engines draw the same tokens.
    Two groups overlap only when their seeds lie within n of each other (about 2n / 2^31 per pair)."""
    return None if seed is None else derive_seed(seed, call_seed, key)


class Sampler(Protocol):
    """What a caller that only samples needs of an engine (lit_ess.engines.RolloutEngine has it): the
    environments' episode runners ask for turns through it without importing the engines.

    version: the optimizer step whose weights the engine holds (0 = the initial checkpoint).
    concurrent: `generate` may be called from several threads at once; otherwise callers take turns.
    generate: n completions for each prompt (token ids), grouped per prompt, seeded as
        RolloutEngine.generate says.
    """

    version: int
    concurrent: ClassVar[bool]

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, call_seed: int = 0,
                 prompt_keys: list[int] | None = None) -> list[list[Completion]]: ...
