"""RolloutDataModule: prompts -> engine samples -> rewards -> group advantages -> optimizer-step batches.

One *rollout phase* is one Lightning epoch: at its first batch the module samples `prompts_per_rollout`
prompts, asks the engine for `samples_per_prompt` completions each, scores them, and splits the rows
into `steps_per_rollout` padded optimizer-step batches. Generation happens lazily when the loop asks
for the phase's first batch, i.e. after the previous phase's last optimizer step and weight refresh,
so Lightning's one-batch prefetch can never make a rollout stale. Set the Trainer's
`reload_dataloaders_every_n_epochs: 1` (the CLI does) so each epoch asks for a new phase.

Each batch (tensors are `[B, L]` aligned with `input_ids` unless noted):
    input_ids, attention_mask, completion_mask (bool), behavior_logprobs,
    advantages [B], rewards [B], versions [B] (policy version that sampled each row),
    prompt_texts, completion_texts (lists of B strings, for logging),
    sampling {temperature, top_k, top_p, max_new_tokens}, stats {rollout/...: float}, phase, index.

`state_dict` carries the prompt cursor, the RNG state, the cumulative reward error/timeout counters, and the current phase's batches with the position
of the next untrained one, so a run killed mid-phase resumes on the same data.
"""
from __future__ import annotations

import random
import time
from typing import Literal
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lit_ess.advantages import group_advantages
from lit_ess.engines import EngineConfig, RolloutEngine, SamplingConfig, VLLMConfig
from lit_ess.rewards import RewardScorer

from .prompts import Arithmetic, Example, PromptSource, encode_prompt


class _PhaseDataset(Dataset):
    def __init__(self, dm: "RolloutDataModule"):
        self.dm = dm

    def __len__(self) -> int:
        return self.dm.steps_per_rollout

    def __getitem__(self, i: int) -> dict:
        return self.dm._phase_batch(i)


class _ResumeSampler(Sampler):
    """Indices start..k-1 while reporting length k, so Lightning's restored batch counter stays right."""

    def __init__(self, k: int, start: int):
        self.k, self.start = k, start

    def __len__(self) -> int:
        return self.k

    def __iter__(self):
        start, self.start = self.start, 0
        return iter(range(start, self.k))


class RolloutDataModule(L.LightningDataModule):
    """Streams engine generations as optimizer-step batches.

    Args:
        model_path: the policy's Hugging Face folder (linked from the model by the CLI).
        source: where prompts come from (default: 2-digit addition).
        engine: the rollout engine's typed config: lit_ess.engines.VLLMConfig (in-process vLLM, the
            default) or lit_ess.engines.HFConfig (transformers generate); e.g. dtype: bfloat16 for a
            precision mismatch.
        sampling: temperature, top_p, top_k, max_new_tokens, stop, seed. With a seed (default 0) every
            request gets its own derived seed, so rollouts are reproducible and resumable.
        reward: "exact_match", "gsm8k", "math_verify" or "module:function".
        reward_timeout: seconds per completion for rewards run in a worker.
        prompts_per_rollout: prompts sampled per phase.
        samples_per_prompt: completions per prompt (the group size).
        steps_per_rollout: optimizer steps per phase; rows are split evenly between them. 1 = on-policy.
        advantage: "zscore" (GRPO) or "mean" (Dr.GRPO).
        drop_degenerate: drop groups whose rewards are all equal (they carry zero advantage). When too
            few rows remain for `steps_per_rollout` steps, dropped groups are restored (in order) until
            every step has a row; `rollout/dropped_groups` counts the groups really dropped.
        max_prompt_tokens: longer prompts are skipped and counted (`rollout/skipped_long_prompts`).
        seed: prompt order.
        val_source: held-out prompts for validation (None = no validation loop).
        val_prompts: validation prompts per batch; every example of val_source is used once.
    """

    def __init__(
        self,
        model_path: str = "",
        source: PromptSource | None = None,
        engine: EngineConfig = VLLMConfig(),
        sampling: SamplingConfig = SamplingConfig(seed=0),
        reward: str = "exact_match",
        reward_timeout: float = 5.0,
        prompts_per_rollout: int = 32,
        samples_per_prompt: int = 8,
        steps_per_rollout: int = 1,
        advantage: Literal["zscore", "mean"] = "zscore",
        drop_degenerate: bool = False,
        max_prompt_tokens: int = 512,
        seed: int = 0,
        val_source: PromptSource | None = None,
        val_prompts: int = 64,
    ):
        super().__init__()
        if steps_per_rollout < 1 or prompts_per_rollout < 1 or samples_per_prompt < 1:
            raise ValueError("prompts_per_rollout, samples_per_prompt and steps_per_rollout must be >= 1")
        if prompts_per_rollout * samples_per_prompt < steps_per_rollout:
            raise ValueError(f"steps_per_rollout={steps_per_rollout} exceeds the {prompts_per_rollout}x"
                             f"{samples_per_prompt} rows of a rollout")
        self.model_path = model_path
        self.source = source if source is not None else Arithmetic()
        if not isinstance(engine, EngineConfig):
            raise ValueError(f"engine must be an engine config (lit_ess.engines.VLLMConfig or HFConfig), got {engine!r}")
        self.engine_config, self.sampling = engine, sampling
        self.reward_name, self.reward_timeout = reward, reward_timeout
        self.prompts_per_rollout, self.samples_per_prompt = prompts_per_rollout, samples_per_prompt
        self.steps_per_rollout, self.advantage = steps_per_rollout, advantage
        self.drop_degenerate, self.max_prompt_tokens, self.seed = drop_degenerate, max_prompt_tokens, seed
        self.val_source, self.val_prompts = val_source, val_prompts
        self.engine: RolloutEngine | None = None
        self.tokenizer = None
        self.scorer: RewardScorer | None = None
        # resumable state
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.cursor = 0
        self.phase = -1
        self.batches: list[dict] | None = None
        self.resume_index = 0
        self.skipped_long_prompts = 0
        self._scorer_state: dict | None = None

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        if self.engine is not None:
            return
        if not self.model_path:
            raise ValueError("RolloutDataModule.model_path is empty: set model.model_path (the CLI links it)")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.scorer = RewardScorer(self.reward_name, self.reward_timeout)
        if self._scorer_state:                       # restored before setup (cumulative counters)
            self.scorer.load_state_dict(self._scorer_state)
        self.engine = self.engine_config.build(self.model_path)

    def teardown(self, stage: str) -> None:
        if self.scorer is not None:
            self.scorer.close()

    def train_dataloader(self) -> DataLoader:
        start = self.resume_index
        self.resume_index = 0
        if start == 0:
            self.batches = None                      # a new phase is generated at the first batch
        return DataLoader(_PhaseDataset(self), batch_size=None, sampler=_ResumeSampler(self.steps_per_rollout, start),
                          num_workers=0)

    def val_dataloader(self):
        if self.val_source is None:
            return []
        ex = [(e.prompt, e.answer) for e in self.val_source.examples]   # tuples: Lightning moves batches
        chunks = [ex[i:i + self.val_prompts] for i in range(0, len(ex), self.val_prompts)]
        return DataLoader(chunks, batch_size=None, collate_fn=lambda x: x)

    @torch.no_grad()
    def evaluate(self, examples: list[tuple[str, str]]) -> dict[str, float]:
        """One sample per held-out (prompt, answer) with the training sampling settings."""
        prompts = [self.encode_prompt(p) for p, _ in examples]
        groups = self.engine.generate(prompts, 1, self.sampling, call_seed=-1)
        texts = [self.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in groups]
        rewards = self.scorer(texts, [a for _, a in examples])
        return {"val/reward_mean": sum(rewards) / len(rewards),
                "val/response_len": sum(len(g[0].token_ids) for g in groups) / len(groups)}

    # ------------------------------------------------------------------ one phase
    def _phase_batch(self, i: int) -> dict:
        if self.batches is None:
            self.batches = self.generate_phase()
        return self.batches[i]

    def _next_examples(self, k: int) -> list[Example]:
        out = []
        while len(out) < k:
            if self.cursor >= len(self.order):
                self.order = list(range(len(self.source)))
                self.rng.shuffle(self.order)
                self.cursor = 0
            out.append(self.source.examples[self.order[self.cursor]])
            self.cursor += 1
        return out

    def encode_prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def _next_prompts(self, k: int) -> tuple[list[Example], list[list[int]]]:
        """k examples that fit max_prompt_tokens, with their token ids; longer ones are skipped and
        counted. Raises only when a streak of skips covers a whole pass over the source (2 x its size
        consecutive draws always contain one full shuffled pass): then no prompt fits."""
        examples, prompts, streak = [], [], 0
        while len(examples) < k:
            for ex in self._next_examples(k - len(examples)):
                ids = self.encode_prompt(ex.prompt)
                if len(ids) > self.max_prompt_tokens:
                    self.skipped_long_prompts += 1
                    streak += 1
                    if streak >= 2 * len(self.source):
                        raise ValueError(f"every prompt of the source is longer than max_prompt_tokens="
                                         f"{self.max_prompt_tokens} tokens: raise max_prompt_tokens")
                    continue
                streak = 0
                examples.append(ex)
                prompts.append(ids)
        return examples, prompts

    @torch.no_grad()
    def generate_phase(self) -> list[dict]:
        """Sample, score and batch one rollout phase."""
        self.phase += 1
        t0 = time.perf_counter()
        examples, prompts = self._next_prompts(self.prompts_per_rollout)
        n = self.samples_per_prompt
        groups = self.engine.generate(prompts, n, self.sampling, call_seed=self.phase)
        t_gen = time.perf_counter() - t0
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
        answers = [ex.answer for ex in examples for _ in range(n)]
        rewards = torch.tensor(self.scorer(texts, answers), dtype=torch.float32).view(len(groups), n)
        adv, degenerate = group_advantages(rewards, self.advantage)

        keep = [g for g in range(len(groups)) if not (self.drop_degenerate and degenerate[g])]
        # every optimizer step needs at least one row: restore dropped groups (zero advantage) until
        # there are steps_per_rollout rows
        restore = [g for g in range(len(groups)) if g not in keep]
        while len(keep) * n < self.steps_per_rollout:
            keep.append(restore.pop(0))
        rows = [(prompts[g], groups[g][j], float(adv[g, j]), float(rewards[g, j]), examples[g].prompt, texts[g * n + j])
                for g in keep for j in range(n)]
        self.rng.shuffle(rows)

        lengths = torch.tensor([len(c.token_ids) for g in groups for c in g], dtype=torch.float32)
        n_tokens = float(lengths.sum())
        stats = {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "rollout/response_len": float(lengths.mean()),
            "rollout/response_len_max": float(lengths.max()),
            "rollout/truncated_frac": sum(c.finish_reason == "length" for g in groups for c in g) / lengths.numel(),
            "rollout/degenerate_frac": float(degenerate.float().mean()),
            "rollout/dropped_groups": float(len(groups) - len(keep)),
            "rollout/gen_seconds": t_gen,
            "rollout/gen_tokens_per_s": n_tokens / max(t_gen, 1e-9),
            "rollout/reward_errors": float(self.scorer.errors),
            "rollout/reward_timeouts": float(self.scorer.timeouts),
            "rollout/skipped_long_prompts": float(self.skipped_long_prompts),
            "data/skipped_rows": float(self.source.skipped),
            "rollout/phase": float(self.phase),
        }
        k = self.steps_per_rollout
        chunks = [rows[i * len(rows) // k:(i + 1) * len(rows) // k] for i in range(k)]
        return [self.collate(chunk, stats, i) for i, chunk in enumerate(chunks)]

    def collate(self, rows, stats: dict, index: int) -> dict:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        L_ = max(len(p) + len(c.token_ids) for p, c, *_ in rows)
        B = len(rows)
        input_ids = torch.full((B, L_), pad, dtype=torch.long)
        attention = torch.zeros(B, L_, dtype=torch.long)
        comp = torch.zeros(B, L_, dtype=torch.bool)
        blp = torch.zeros(B, L_, dtype=torch.float32)
        for r, (p, c, *_) in enumerate(rows):
            P, T = len(p), len(c.token_ids)
            input_ids[r, :P + T] = torch.tensor(p + c.token_ids)
            attention[r, :P + T] = 1
            comp[r, P:P + T] = True
            blp[r, P:P + T] = torch.tensor(c.logprobs, dtype=torch.float32)
        return {
            "input_ids": input_ids, "attention_mask": attention, "completion_mask": comp,
            "behavior_logprobs": blp,
            "advantages": torch.tensor([row[2] for row in rows], dtype=torch.float32),
            "rewards": torch.tensor([row[3] for row in rows], dtype=torch.float32),
            "versions": torch.tensor([row[1].version for row in rows], dtype=torch.long),
            "prompt_texts": [row[4] for row in rows], "completion_texts": [row[5] for row in rows],
            "sampling": {"temperature": self.sampling.temperature, "top_k": self.sampling.top_k,
                         "top_p": self.sampling.top_p, "max_new_tokens": self.sampling.max_new_tokens},
            "stats": dict(stats), "phase": self.phase, "index": index,
        }

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        module = self.trainer.lightning_module if self._trainer_attached() else None
        pos = getattr(module, "rollout_position", None)
        next_index = pos[1] + 1 if pos is not None and pos[0] == self.phase else 0
        keep_batches = self.batches is not None and 0 < next_index < len(self.batches)
        return {
            "cursor": self.cursor, "order": self.order, "phase": self.phase, "rng": self.rng.getstate(),
            "skipped_long_prompts": self.skipped_long_prompts,
            "reward_counters": self.scorer.state_dict() if self.scorer is not None else self._scorer_state,
            "batches": self.batches if keep_batches else None,
            "next_index": next_index if keep_batches else 0,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.order, self.phase = state["cursor"], list(state["order"]), state["phase"]
        self.rng.setstate(_as_tuple(state["rng"]))
        self.skipped_long_prompts = state.get("skipped_long_prompts", 0)
        self._scorer_state = state.get("reward_counters")
        if self.scorer is not None and self._scorer_state:
            self.scorer.load_state_dict(self._scorer_state)
        self.batches = state.get("batches")
        self.resume_index = state.get("next_index", 0) if self.batches is not None else 0

    def _trainer_attached(self) -> bool:
        try:
            return self.trainer is not None and self.trainer.lightning_module is not None
        except RuntimeError:
            return False


def _as_tuple(x):
    """random.Random state survives torch.save as nested lists/tuples; setstate wants tuples."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
