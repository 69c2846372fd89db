"""The rollout-engine interface: generate n samples per prompt with the behaviour logprob of each
sampled token, load new weights, close, report the policy version.

Every engine returns, for each prompt, n `Completion`s whose `logprobs[i]` is the log-probability the
engine really sampled `token_ids[i]` with (after temperature, top-k and top-p): that is pi_b. The
settings, the completions and the seeds are lit_ess.sampling's: the layers below the engines use them too.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable, Literal

from torch import Tensor

from ..sampling import Completion, SamplingConfig


@dataclass(frozen=True)
class WeightTransfer:
    """How an engine built from a config receives weights, as plain values; the rollout layer builds
    the carrier (lit_ess/rollout/transport.py: `build_transport`).

    kind: "in_process" (sync mode: the engine reads the trainer's tensors, no transport), "shared_memory" (a slot of host shared
        memory, for an engine in the async worker process), "nccl" (vLLM's NCCL weight transfer) or
        "version_only" (another trainer rank pushes the weights; the engine is told the step only).
    bucket_mb, engine_ranks: nccl only, the bucket size and the engine's GPU workers.
    """
    kind: Literal["in_process", "shared_memory", "nccl", "version_only"]
    bucket_mb: float = 256.0
    engine_ranks: int = 1


class EngineConfig:
    """Base of the engines' typed configs: a config names its engine's settings (shown by
    `--print_config`) and `build(model_path)` starts the engine. Configs are plain values, so one can
    be shipped to another process and built there."""

    def build(self, model_path: str) -> "RolloutEngine":
        raise NotImplementedError

    def hparams(self) -> dict:
        """Plain values to log as hyper-parameters: the config's class name and its fields."""
        from dataclasses import asdict

        return {"name": type(self).__name__, **asdict(self)}

    def weight_transfer(self, in_process: bool) -> WeightTransfer:
        """How weights reach an engine built from this config: built in the trainer's process (sync
        mode) or in the async worker process. Default: the engine reads the trainer's tensors (in
        process) or a shared-memory slot (worker process)."""
        return WeightTransfer("in_process" if in_process else "shared_memory")

    def exact_dtype(self) -> str | None:
        """The dtype in which this engine's behaviour logprobs equal the trainer's at policy lag 0 (same
        weights, same sampling settings), or None when they are not meant to (raw or quantized
        logprobs; an engine that does not say). The lag-0 ESS alarm (model.ess_alarm) applies
        only when it equals the trainer's dtype."""
        return None

    def adapter_error(self, rank: int) -> str | None:
        """Why this engine cannot serve LoRA adapters of rank `rank` pushed alone (model.lora.sync: adapter),
        or None when it can. Default: it takes full weights only."""
        return (f"model.lora.sync: adapter pushes adapters, which the {type(self).__name__} engine does not take: "
                f"use model.lora.sync: merged, or lit_ess.engines.VLLMConfig with max_lora_rank")

    def model_len(self, model_path: str) -> tuple[int, str] | None:
        """The longest prompt + completion this engine takes with the model at `model_path`, and the knob
        that sets it; None when the model's config does not say. Default: the model's
        max_position_embeddings."""
        return position_limit(model_path)

    def updates_in_flight(self) -> bool:
        """Whether the engine takes new weights while it generates (requests running go on with them,
        each token labelled with its version in `Completion.token_versions`), so the async worker
        loads a push at once instead of before its next request. Default: no, weights change between
        requests."""
        return False

    def worker_env(self) -> dict[str, str]:
        """Environment variables for the async worker process only (e.g. CUDA_VISIBLE_DEVICES for an
        engine on its own GPUs). Default: none, the worker sees the trainer's devices (colocated)."""
        return {}


class EngineFault(RuntimeError):
    """An engine that failed mid-run for a reason outside the trainer (a server that died or stopped
    answering), said in one line that names where: the run stops with that line, not a traceback."""


class RolloutEngine(ABC):
    """What every engine does: generate, load weights, close; and report its version. `version` is the
    optimizer step whose weights the engine holds (0 = the initial checkpoint). `concurrent`: `generate`
    may be called from several threads at once (an HTTP client); otherwise callers that have several
    threads (users' agents) take turns. The environments call an engine as a lit_ess.sampling.Sampler,
    which every RolloutEngine is. What one weight transport needs of an engine beyond this is declared
    beside it (lit_ess.rollout.transport: `NCCLReceiver`)."""

    version: int = 0
    concurrent: ClassVar[bool] = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, call_seed: int = 0,
                 prompt_keys: list[int] | None = None) -> list[list[Completion]]:
        """n completions for each prompt (token ids), grouped per prompt.

        A prompt's group is seeded group_seed(sampling.seed, call_seed, key of the prompt), its sample j
        with that seed + j (the vLLM engines; the hf engine seeds chunks of rows); a prompt's key is its
        entry in `prompt_keys` (default: its index in `prompts`). Data-parallel ranks
        pass the prompt's position in the whole step, so a sharded run samples what one rank would."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace the engine's weights (Hugging Face parameter names) and set `version`."""

    def close(self) -> None:
        """Free the engine's resources."""


def position_limit(model_path: str) -> tuple[int, str] | None:
    """(max_position_embeddings, its name) of the model's config, or None when it has none."""
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    return (n, "the model's max_position_embeddings") if isinstance(n, int) and n > 0 else None


def capped_limit(max_model_len: int | None, model_path: str) -> tuple[int, str] | None:
    """An engine's `max_model_len` knob when it is below the model's max_position_embeddings (or the
    model does not say), else the model's limit (position_limit)."""
    model = position_limit(model_path)
    if max_model_len is not None and (model is None or max_model_len < model[0]):
        return max_model_len, "engine.max_model_len"
    return model


def prompt_budget(max_prompt_tokens: int | None, max_new_tokens: int, limit: tuple[int, str] | None) -> int:
    """The longest prompt a run samples: `max_prompt_tokens`, or with None the engine's model length
    minus `max_new_tokens`. Raises ValueError naming both knobs when prompt + completion cannot fit."""
    if limit is None:
        if max_prompt_tokens is None:
            raise ValueError("max_prompt_tokens is null and the model's config has no max_position_embeddings: set "
                             "data.max_prompt_tokens")
        return max_prompt_tokens
    n, what = limit
    if max_prompt_tokens is None:
        if max_new_tokens >= n:
            raise ValueError(f"sampling.max_new_tokens={max_new_tokens} leaves no room for a prompt in {what} = {n}")
        return n - max_new_tokens
    if max_prompt_tokens + max_new_tokens > n:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} + sampling.max_new_tokens={max_new_tokens} = "
                         f"{max_prompt_tokens + max_new_tokens} exceeds {what} = {n}: lower one of them (or leave "
                         f"max_prompt_tokens null: the room the model length leaves)")
    return max_prompt_tokens


def truncate_at_stop(text_of, token_ids: list[int], eos_id: int | None, stop: list[str]) -> tuple[int, str]:
    """Length to keep and finish reason for `token_ids`: up to and including the first eos, or the
    first token whose decoded prefix contains a stop string; else everything, reason "length"."""
    for i, t in enumerate(token_ids):
        if eos_id is not None and t == eos_id:
            return i + 1, "stop"
        if stop and any(s in text_of(token_ids[: i + 1]) for s in stop):
            return i + 1, "stop"
    return len(token_ids), "length"


def require_cuda(what: str) -> None:
    """Raise a one-line error naming `what` when this machine has no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{what} needs CUDA GPUs (and NCCL); this machine has none "
                         f"(torch.cuda.is_available() is False)")


def devices_env(devices: list[int] | None) -> dict[str, str]:
    """The worker process's environment for an engine on `devices` (engine.worker_devices, numbered as
    this process sees them): its CUDA_VISIBLE_DEVICES; {} for None (the trainer's devices)."""
    if devices is None:
        return {}
    import torch

    require_cuda(f"engine.worker_devices={devices}")
    if max(devices) >= torch.cuda.device_count():
        raise ValueError(f"engine.worker_devices={devices}: this process sees {torch.cuda.device_count()} CUDA devices")
    return {"CUDA_VISIBLE_DEVICES": visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))}


def visible_devices(indices: list[int], parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker process: `indices` number the devices the trainer's process sees,
    so under a parent CUDA_VISIBLE_DEVICES they map through it (indices [1] under "4,5" -> "5")."""
    if not parent_visible:
        return ",".join(map(str, indices))
    seen = [v.strip() for v in parent_visible.split(",") if v.strip()]
    if max(indices) >= len(seen):
        raise ValueError(f"engine.worker_devices={indices}: CUDA_VISIBLE_DEVICES={parent_visible!r} shows "
                         f"{len(seen)} devices")
    return ",".join(seen[i] for i in indices)
