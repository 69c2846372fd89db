"""What the trainer asks a rollout worker for: a phase of prompts to sample and score, or held-out prompts to
evaluate (lit_ess/rollout/worker.py answers both)."""
from __future__ import annotations

from dataclasses import dataclass

from lit_ess.sampling import SamplingConfig


@dataclass
class RolloutRequest:
    """This rank's prompts of one phase. `prompt_ids` index the prompt source; `prompts` are token ids;
    `prompt_keys` are their positions among the phase's prompts on all ranks (they derive the request
    seeds; None = 0, 1, ...)."""
    phase: int
    prompt_ids: list[int]
    prompts: list[list[int]]
    prompt_texts: list[str]
    answers: list[str]
    prompt_keys: list[int] | None = None
    columns: list[dict] | None = None     # each prompt's dataset row, for rewards that take columns by name
    conversations: list | None = None     # each prompt's chat messages (None for a text prompt), for a reward model
    round: int = 0                        # dynamic sampling: the phase's generation round (0: its first)


@dataclass
class EvalRequest:
    """Held-out prompts (token ids) with their answers, `n` samples each; `keys` (the prompts'
    positions in the held-out set) derive the request seeds, so any sharding samples the same (vllm
    engine; the hf engine seeds per chunk). `sampling`: None = the worker's training settings."""
    prompts: list[list[int]]
    answers: list[str]
    keys: list[int]
    n: int = 1
    sampling: SamplingConfig | None = None
    prompt_texts: list[str] | None = None
    columns: list[dict] | None = None
    conversations: list | None = None
