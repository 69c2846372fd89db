"""A reward model: a sequence-classification checkpoint whose one logit scores prompt + completion.

TRL's `reward_funcs=<model id>` and OpenRLHF's `--reward_pretrain`: the texts of a phase go through
`AutoModelForSequenceClassification` in batches of `batch_size`, padded on the right; the model pools the
logit of each text's last non-pad token (transformers finds it from `config.pad_token_id`, which is set
from the tokenizer when the checkpoint lacks it), and that logit is the reward:

    text_i  = chat_template([*messages_i, assistant: completion_i])   (or prompt_i + completion_i)
    r_i     = model(tokens(text_i)[-L:]).logits[0]                     logits: [B, 1], L = max positions

messages_i is a chat prompt's own conversation (system message and turns as the dataset row has them), or
[user: prompt_i] for a text prompt. A text longer than the model's positions L keeps its last L tokens (the
completion, whose last token is pooled), and the run warns once, counting them in `truncated`.

The model is loaded once per process that scores (the trainer's in sync mode, the rollout worker's in
async mode), on the first call, and kept for the run.
"""
from __future__ import annotations

import threading
import warnings
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
    truncated = 0                        # texts of this process cut to the model's positions so far

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

    def texts(self, prompts: list[str], completions: list[str], tokenizer,
              conversations: list | None = None) -> list[str]:
        """Each sample as the model reads it: its conversation (a chat prompt's messages, else the prompt as
        a user message) and the completion as the assistant's, in the model's template; or plain text."""
        if not self.chat_template:
            return [p + c for p, c in zip(prompts, completions)]
        if not tokenizer.chat_template:
            raise ValueError(f"reward model {self.path!r} has no chat template: set RewardModel.chat_template: false "
                             f"(prompt + completion as plain text)")
        conversations = conversations or [None] * len(prompts)
        return [tokenizer.apply_chat_template([*(m or [{"role": "user", "content": p}]),
                                               {"role": "assistant", "content": c}], tokenize=False)
                for p, c, m in zip(prompts, completions, conversations)]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], conversations: list | None = None) -> list[float]:
        model, tok = self.load()
        texts = self.texts(prompts, completions, tok, conversations)
        limit = positions(model.config, tok)
        scores, cut = [], 0
        for i in range(0, len(texts), self.batch_size):
            batch = texts[i:i + self.batch_size]
            ids = tok(batch, add_special_tokens=not self.chat_template)["input_ids"]      # tokenized once
            cut += sum(len(x) > limit for x in ids)
            enc = tok.pad({"input_ids": [x[-limit:] for x in ids]}, padding=True,       # left truncation: the end,
                          return_tensors="pt").to(model.device)                          # pooled, stays
            logits = model(**enc).logits                          # [B, 1]
            scores += logits[:, 0].float().tolist()
        if cut:
            if not self.truncated:
                warnings.warn(f"reward model {self.path!r}: {cut} of {len(texts)} texts are longer than its "
                              f"{limit} positions and keep their last {limit} tokens (warned once)", stacklevel=2)
            self.truncated += cut
        return scores


def positions(config, tokenizer) -> int:
    """The longest text the model reads, in tokens: its position table's size."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or \
        tokenizer.model_max_length


def _load(path: str, device: str, dtype: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    labels = AutoConfig.from_pretrained(path).num_labels        # before the weights: a causal LM's config says 2
    if labels != 1:
        raise ValueError(f"reward model {path!r} has {labels} labels: a reward model gives one score per text (a "
                         f"sequence-classification checkpoint with num_labels: 1)")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right"
    tok.truncation_side = "left"                     # a text past the positions keeps its end: the pooled token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token                # as TRL: the last non-pad token is the text's own last
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok
