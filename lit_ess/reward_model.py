"""A reward model: a sequence-classification checkpoint whose one logit scores prompt + completion.

TRL's `reward_funcs=<model id>` and OpenRLHF's `--reward_pretrain`: the texts of a phase go through
`AutoModelForSequenceClassification` in batches of `batch_size`, padded on the right; the model pools the
logit of each text's last non-pad token (transformers finds it from `config.pad_token_id`, which is set
from the tokenizer when the checkpoint lacks it), and that logit is the reward:

    text_i  = chat_template([user: prompt_i, assistant: completion_i])   (or prompt_i + completion_i)
    r_i     = model(tokens(text_i)).logits[0]                             logits: [B, 1]

The model is loaded once per process that scores (the trainer's in sync mode, the rollout worker's in
async mode), on the first call, and kept for the run.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

from .knobs import check
from .model_path import check_model_path
from .rewards import ModelReward

_LOADED: dict[tuple, tuple] = {}        # (path, device, dtype) -> (model, tokenizer), one per process
_LOCK = threading.Lock()


@dataclass
class RewardModel(ModelReward):
    """A sequence-classification reward model, scored in batches; logged as train/reward/reward_model unless named.

    Args:
        path: a Hugging Face folder or hub name of a checkpoint AutoModelForSequenceClassification loads
            with one label (num_labels: 1): its logit is the reward.
        chat_template: render each sample as a user message (the prompt) and an assistant message (the
            completion) with the reward model's own chat template (the tokenizer must have one); false:
            the prompt's text followed by the completion's, with the tokenizer's special tokens.
        batch_size: texts per forward pass, >= 1.
        device: where the model runs ("cpu", "cuda", "cuda:1"); None = the current CUDA device when
            there is one, else the CPU.
        dtype: the model's precision; auto = the checkpoint's.
    """

    path: str
    chat_template: bool = True
    batch_size: int = 16
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"

    label = "reward_model"

    def __post_init__(self):
        check_model_path(self.path, "RewardModel.path")
        check("RewardModel.batch_size", self.batch_size, ge=1, integer=True)
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"RewardModel.dtype={self.dtype!r} is not one of ('float32', 'bfloat16', 'float16', 'auto')")

    def load(self):
        """(model, tokenizer), loaded on the first call of this process."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        key = (self.path, device, self.dtype)
        with _LOCK:
            if key not in _LOADED:
                _LOADED[key] = _load(self.path, device, self.dtype)
        return _LOADED[key]

    warm_up = load

    def texts(self, prompts: list[str], completions: list[str], tokenizer) -> list[str]:
        if not self.chat_template:
            return [p + c for p, c in zip(prompts, completions)]
        if not tokenizer.chat_template:
            raise ValueError(f"reward model {self.path!r} has no chat template: set RewardModel.chat_template: false "
                             f"(prompt + completion as plain text)")
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                              tokenize=False) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        model, tok = self.load()
        texts = self.texts(prompts, completions, tok)
        scores = []
        for i in range(0, len(texts), self.batch_size):
            enc = tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                      add_special_tokens=not self.chat_template).to(model.device)
            logits = model(**enc).logits                          # [B, 1]
            scores += logits[:, 0].float().tolist()
        return scores


def _load(path: str, device: str, dtype: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    labels = AutoConfig.from_pretrained(path).num_labels        # before the weights: a causal LM's config says 2
    if labels != 1:
        raise ValueError(f"reward model {path!r} has {labels} labels: a reward model gives one score per text (a "
                         f"sequence-classification checkpoint with num_labels: 1)")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token                # as TRL: the last non-pad token is the text's own last
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok
