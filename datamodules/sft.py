"""SFTDataModule: (prompt, answer + eos) pairs from a prompt source, for the supervised warm start.

Prompts are encoded as the RolloutDataModule encodes them (chat template when the tokenizer has one),
so the warm start trains the policy on the very inputs RL samples from."""
from __future__ import annotations

import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lit_ess.knobs import check

from lit_ess.chat import ChatFormat, check_format

from .prompts import Arithmetic, PromptSource, check_chat, encode_prompt


class _Pairs(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class SFTDataModule(L.LightningDataModule):
    """(prompt, answer + eos) pairs from a prompt source, for the supervised warm start.

    Args:
        model_path: tokenizer folder (linked from the model by the CLI).
        source: prompt source whose answers are the targets.
        chat: how prompts are rendered (lit_ess.chat.ChatFormat), as RolloutDataModule's `chat`: give both
            the same, so the warm start trains on the inputs RL samples from.
        batch_size: pairs per step, >= 1.
        label_noise: fraction of targets replaced by a wrong answer (another example's), in [0, 1), to make
            a deliberately imperfect warm start that RL can improve on (0 = none).
        seed: shuffling and label noise (an integer >= 0).
    """

    def __init__(self, model_path: str = "", source: PromptSource | None = None, chat: ChatFormat = ChatFormat(),
                 batch_size: int = 64, label_noise: float = 0.0, seed: int = 0):
        super().__init__()
        check_format(chat)
        check("data.batch_size", batch_size, ge=1, integer=True)
        check("data.label_noise", label_noise, ge=0, lt=1)
        check("data.seed", seed, ge=0, integer=True)
        self.model_path, self.source = model_path, source if source is not None else Arithmetic()
        self.batch_size, self.label_noise, self.seed, self.chat = batch_size, label_noise, seed, chat

    def setup(self, stage: str) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        check_chat(tok, self.chat, [self.source])
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rng = random.Random(self.seed)
        items = []
        for ex in self.source.examples:
            answer = ex.answer
            if self.label_noise and rng.random() < self.label_noise:
                answer = rng.choice(self.source.examples).answer
            p = encode_prompt(tok, ex.prompt, self.chat)            # exactly the ids RL will prompt with
            a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            items.append((p, a))
        self.items = items

    def collate(self, rows):
        L_ = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), L_), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        loss = torch.zeros_like(ids, dtype=torch.bool)
        for r, (p, a) in enumerate(rows):
            ids[r, :len(p) + len(a)] = torch.tensor(p + a)
            att[r, :len(p) + len(a)] = 1
            loss[r, len(p):len(p) + len(a)] = True
        return {"input_ids": ids, "attention_mask": att, "loss_mask": loss}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(_Pairs(self.items), batch_size=self.batch_size, shuffle=True, generator=g,
                          collate_fn=self.collate, drop_last=True)
