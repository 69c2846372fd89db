"""transformers `generate` as a rollout engine: slower than vLLM, no extra dependency, same meaning.

The behaviour logprob of each sampled token is recomputed from the logits `generate` sampled from,
with the same temperature / top-k / top-p processing as the trainer (lit_ess.logprobs). A logits
processor (`StepLogprobs`) scores each step's token at the next step, so only one step's [N, V]
scores are kept, never the [N, T, V] logits of the whole generation.

It samples with exactly those three processors. A model folder's `generation_config.json` may carry
others (repetition_penalty, min_p, no_repeat_ngram_size, ... which several instruct models ship);
`generate()` would apply them while the recorded pi_b would not, so the engine replaces the model's
generation config with a clean one and logs (INFO) what it ignored. vLLM needs no such care: it
applies only the SamplingParams it is given, and its processed logprobs are what it sampled from.
"""
from __future__ import annotations

from typing import Iterable

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..health import NonFiniteError, first_nonfinite
from ..logprobs import process_logits
from .base import EngineConfig, RolloutEngine, truncate_at_stop
from ..lora import is_adapter_payload
from ..knobs import check
from ..sampling import Completion, SamplingConfig, derive_seed

log = logging.getLogger(__name__)


@dataclass
class HFConfig(EngineConfig):
    """transformers `generate` as the rollout engine (no vLLM needed; slower).

    Args:
        dtype: engine precision: float32, bfloat16 or float16.
        device: where the engine's copy of the model lives (cpu, cuda, cuda:1, ...).
        batch_size: sequences generated at once, >= 1.
        behavior_logprobs: "processed" (the distribution sampled from: temperature, top-k, top-p) or
            "raw" (log-softmax of the untempered, untruncated logits, what the authors' code records).
    """

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    batch_size: int = 256
    behavior_logprobs: Literal["processed", "raw"] = "processed"

    def __post_init__(self):
        if self.behavior_logprobs not in ("processed", "raw"):
            raise ValueError(f"behavior_logprobs={self.behavior_logprobs!r} is not one of ('processed', 'raw')")
        check("HFConfig.batch_size", self.batch_size, ge=1, integer=True)

    def exact_dtype(self) -> str | None:
        return None if self.behavior_logprobs == "raw" else self.dtype

    def build(self, model_path: str) -> "HFEngine":
        return HFEngine(model_path, self)


class HFEngine(RolloutEngine):
    """A transformers copy of the model at `model_path`, sampling with the settings of `config`."""

    def __init__(self, model_path: str, config: HFConfig | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        c = config if config is not None else HFConfig()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, c.dtype)).to(c.device).eval()
        self.ignored_generation_config = _reset_generation_config(self.model, self.tokenizer)
        if self.ignored_generation_config:
            log.info("hf engine: ignoring %s from %s/generation_config.json (pi_b replays only temperature, "
                     "top_k and top_p)", self.ignored_generation_config, model_path)
        self.device, self.batch_size, self.version = c.device, c.batch_size, 0
        self.raw = c.behavior_logprobs == "raw"
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, call_seed: int = 0,
                 prompt_keys: list[int] | None = None) -> list[list[Completion]]:
        """One seed per chunk of `batch_size` rows, derived from the key of the chunk's first prompt."""
        flat_prompts = [p for p in prompts for _ in range(n)]
        keys = list(range(len(prompts))) if prompt_keys is None else list(prompt_keys)
        flat: list[Completion] = []
        for start in range(0, len(flat_prompts), self.batch_size):
            chunk = flat_prompts[start:start + self.batch_size]
            seed = None if sampling.seed is None else derive_seed(sampling.seed, call_seed, keys[start // n], start % n)
            flat.extend(self._generate_chunk(chunk, sampling, seed))
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _generate_chunk(self, prompts: list[list[int]], s: SamplingConfig, seed: int | None) -> list[Completion]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, p in enumerate(prompts):                      # left padding for generation
            ids[r, width - len(p):] = torch.tensor(p)
            att[r, width - len(p):] = 1
        scorer = StepLogprobs(self._finite_scores, *((1.0, -1, 1.0) if self.raw else (s.temperature, s.top_k, s.top_p)))
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=att.to(self.device), do_sample=True,
                temperature=s.temperature, top_k=s.top_k if s.top_k > 0 else 0, top_p=s.top_p,
                max_new_tokens=s.max_new_tokens, return_dict_in_generate=True,
                pad_token_id=self.pad_id, eos_token_id=self.tokenizer.eos_token_id,
                logits_processor=[scorer])
        new = out.sequences[:, width:]                                    # [N, T]
        lps = scorer.finish(new).cpu()                                    # [N, T]
        new = new.cpu()
        result = []
        for r in range(len(prompts)):
            toks = new[r].tolist()
            keep, reason = truncate_at_stop(self._text, toks, self.tokenizer.eos_token_id, s.stop)
            result.append(Completion(toks[:keep], lps[r, :keep].tolist(), reason, self.version))
        return result

    def _finite_scores(self, scores: Tensor) -> None:
        """Next-token scores [N, V] with a NaN or +inf cannot be sampled from (torch.multinomial would raise a
        bare error): stop with one line naming the first non-finite weight, if any."""
        if bool(scores.isnan().any()) or bool(scores.isposinf().any()):
            bad = first_nonfinite(self.model.named_parameters())
            why = f"weight {bad} is not finite" if bad else f"the logits overflow in {self.model.dtype}"
            raise NonFiniteError(f"hf engine: the next-token probabilities of the weights of step {self.version} are "
                                 f"not finite ({why}): nothing can be sampled")

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)     # as vLLM matches stop strings

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        state = {k: v.detach() for k, v in named_tensors}
        if is_adapter_payload(list(state)):
            raise ValueError("the hf engine takes full weights: use model.lora.sync: merged (or the vllm engine)")
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if real_missing or unexpected:
            raise ValueError(f"HFEngine.load_weights: missing {real_missing[:5]}, unexpected {unexpected[:5]}")
        self.version = version


class StepLogprobs:
    """A logits processor that records the behaviour logprob of every sampled token, one step late.

    `generate` calls it with the raw next-token scores [N, V] before its own temperature / top-k / top-p
    warpers (custom processors run first). At step t it processes the scores as the trainer does
    (lit_ess.logprobs.process_logits) and keeps them, [N, V]; at step t + 1 the ids end with the token
    sampled from them, whose logprob it gathers, [N]. `finish` gathers the last step's."""

    def __init__(self, check, temperature: float, top_k: int, top_p: float):
        self.check, self.processing = check, (temperature, top_k, top_p)
        self.x: Tensor | None = None                # [N, V] processed scores of the last step
        self.lse: Tensor | None = None              # [N]
        self.out: list[Tensor] = []                 # [N] per generated token

    def _gather(self, tokens: Tensor) -> None:
        self.out.append(self.x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - self.lse)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.check(scores)
        if self.x is not None:
            self._gather(input_ids[:, -1])
        self.x = process_logits(scores, *self.processing)
        self.lse = torch.logsumexp(self.x, dim=-1)
        return scores

    def finish(self, new: Tensor) -> Tensor:
        """[N, T] logprobs of the generated tokens `new` ([N, T])."""
        if self.x is not None and len(self.out) < new.shape[1]:
            self._gather(new[:, len(self.out)])
        return torch.stack(self.out, 1) if self.out else new.new_zeros(new.shape, dtype=torch.float32)


def _reset_generation_config(model, tokenizer) -> dict:
    """Replace `model.generation_config` by one with no sampling processors; return what was dropped."""
    from transformers import GenerationConfig

    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    dropped = {k: v for k, v in model.generation_config.to_diff_dict().items()
               if k not in ids and not k.startswith("_") and k != "transformers_version"}
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    return dropped
