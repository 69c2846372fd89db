"""A tiny causal LM built fully offline, for tests and the CPU demo.

`build_tiny_model(out_dir)` writes a Hugging Face model folder (config.json, model.safetensors,
tokenizer.json, generation_config.json) that both transformers and vLLM load. The tokenizer is
byte-level with no merges: every byte is one token, so any text round-trips and the vocabulary is
256 bytes plus four special tokens (pad, bos, eos = <|endoftext|>, sep). The default network is a 4-layer Qwen2 of width 192 (about 2M
parameters) with head size 64, which vLLM's CPU attention supports.

`family` picks what the model is built from (FAMILIES: the demo's Qwen2, and Qwen2.5, Qwen3 and Llama 3
with their own traits: q/k norms, untied embeddings, RoPE scaling). `tokenizer="bpe_chat"` builds the model on a byte-level BPE *with merges* trained here on arithmetic
conversations, and a ChatML chat template whose eos is <|im_end|>: the sampler can emit '5', '7', '9'
as three ids where encoding the text '579' gives one, so decoding and re-encoding changes the ids
(what the multi-turn token-in-token-out tests need; lit_ess/envs/episodes.py).

    python -m lit_ess.tiny runs/tiny            # or: lit-ess-tiny runs/tiny
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|sep|>"]
HEAD_DIM = 64              # the command line's head size: --hidden-size 128 gives 2 heads, 192 gives 3


def build_tokenizer():
    """Byte-level BPE with no merges: 256 byte tokens + pad/bos/eos/sep."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        sep_token="<|sep|>",
        model_max_length=512,
    )


CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """Byte-level BPE with merges, trained on arithmetic conversations (numbers split from symbols, as
    GPT-2's pre-tokenizer does, so frequent numbers such as '579' become one token), with a ChatML
    template: pad = <|endoftext|>, eos = <|im_end|>, no bos."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = []
    for _ in range(6000):
        a, op, b = rng.randrange(100), rng.choice("+-*"), rng.randrange(100)
        q, r = f"{a}{op}{b}=", str(a + b if op == "+" else a - b if op == "-" else a * b)
        corpus.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\ncalc({a}{op}{b})<|im_end|>\n"
                      f"<|im_start|>user\n{r}\nwrong\n{q}<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>\n")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=CHAT_SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


# The families users train, as tiny models that keep what sets each apart (numbers from the public
# config.json of the named checkpoint; width, depth and vocabulary are the caller's):
#   qwen2    the demo's model: Qwen2, tied embeddings, q/k/v biases
#   qwen2.5  Qwen2.5-0.5B: Qwen2, grouped-query attention, rope_theta 1e6, rms_norm_eps 1e-6, tied embeddings
#   qwen3    Qwen3-0.6B: Qwen3 (RMS norms on q and k per head, no attention bias), GQA, rope_theta 1e6, tied
#   llama3   Llama-3.1-8B: Llama, untied embeddings, GQA, rope_theta 5e5, llama3 RoPE scaling (factor 8,
#            low/high frequency factors 1 and 4; its original context, 8,192 of 131,072, is kept as a
#            fraction: max_position_embeddings / 16, so the scaling acts on a tiny model's context too)
FAMILIES = {
    "qwen2": ("Qwen2", {}),
    "qwen2.5": ("Qwen2", {"kv_ratio": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                          "rms_norm_eps": 1e-6}),
    "qwen3": ("Qwen3", {"kv_ratio": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                        "rms_norm_eps": 1e-6, "attention_bias": False}),
    "llama3": ("Llama", {"kv_ratio": 2, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
}


def family_config(family: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                  intermediate_size: int, max_position_embeddings: int, **extra):
    """A transformers config of `family` (FAMILIES) at the given shape, fp32. kv heads = heads / the
    family's GQA ratio (at least 1) unless `num_key_value_heads` is given."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {sorted(FAMILIES)}")
    name, traits = FAMILIES[family]
    traits = dict(traits)
    if traits.get("rope_parameters", {}).get("rope_type") == "llama3":
        traits["rope_parameters"] = {**traits["rope_parameters"],
                                     "original_max_position_embeddings": max(max_position_embeddings // 16, 1)}
    kv = extra.pop("num_key_value_heads", None) or max(num_heads // traits.pop("kv_ratio", 1), 1)
    traits.pop("kv_ratio", None)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    config_cls = getattr(transformers, f"{name}Config")
    return config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=kv,
                      head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
                      **{"tie_word_embeddings": True, **traits, **extra}, dtype="float32")


def build_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "qwen2",
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 3,
    num_kv_heads: int | None = None,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    attention_dropout: float = 0.0,
    seed: int = 0,
    tokenizer: str | None = None,
) -> Path:
    """Write a randomly initialised tiny causal LM of `family` (FAMILIES) and its tokenizer to `out_dir`;
    return the path. `tokenizer`: "bytes" (no merges, no chat template; the qwen2 default) or "bpe_chat"
    (`build_chat_tokenizer`; the default of the other families). `num_kv_heads` overrides the family's."""
    import transformers
    from transformers import GenerationConfig

    tokenizer = tokenizer or ("bytes" if family == "qwen2" else "bpe_chat")
    tokenizers = {"bytes": build_tokenizer, "bpe_chat": build_chat_tokenizer}
    if tokenizer not in tokenizers:
        raise ValueError(f"tokenizer={tokenizer!r} is not one of {sorted(tokenizers)}")
    tok = tokenizers[tokenizer]()
    extra = {} if num_kv_heads is None else {"num_key_value_heads": num_kv_heads}
    config = family_config(family, len(tok), hidden_size, num_layers, num_heads, intermediate_size,
                           max_position_embeddings, attention_dropout=attention_dropout,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM")(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    return out


def build_tiny_reward_model(out_dir: str | Path, *, hidden_size: int = 128, num_layers: int = 2, seed: int = 0) -> Path:
    """Write a randomly initialised tiny reward model (Qwen2ForSequenceClassification, one label, the byte
    tokenizer, pad_token_id set) to `out_dir`; return the path. lit_ess.reward_model.RewardModel loads it."""
    from transformers import Qwen2ForSequenceClassification

    tok = build_tokenizer()
    config = family_config("qwen2", len(tok), hidden_size, num_layers, hidden_size // HEAD_DIM, 2 * hidden_size, 256,
                           num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    out = Path(out_dir)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")     # no "Writing model shards" bar
    p = argparse.ArgumentParser(description="Build a tiny offline causal LM folder.")
    p.add_argument("out_dir")
    p.add_argument("--family", default="qwen2", choices=sorted(FAMILIES),
                   help="qwen2: the demo's model; qwen2.5, qwen3, llama3: what sets each family apart, at tiny size")
    p.add_argument("--hidden-size", type=int, default=192, help=f"a multiple of the head size, {HEAD_DIM}")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, choices=["bytes", "bpe_chat"],
                   help="bytes: no merges, no chat template (qwen2's default); bpe_chat: BPE with merges and a "
                        "ChatML template (the other families' default)")
    a = p.parse_args(argv)
    if a.hidden_size < HEAD_DIM or a.hidden_size % HEAD_DIM or a.num_layers < 1:
        bad = f"--num-layers {a.num_layers} must be >= 1" if a.num_layers < 1 else (
            f"--hidden-size {a.hidden_size} must be a positive multiple of {HEAD_DIM} (the head size, which vLLM's "
            f"CPU attention supports), e.g. 128 or 192")
        print(f"lit-ess-tiny: error: {bad}", file=sys.stderr)
        sys.exit(2)
    heads = a.hidden_size // HEAD_DIM
    path = build_tiny_model(a.out_dir, family=a.family, hidden_size=a.hidden_size, num_layers=a.num_layers,
                            num_heads=heads, seed=a.seed, tokenizer=a.tokenizer)
    print(f"wrote {path} (vocab {json.loads((path / 'config.json').read_text())['vocab_size']})")


if __name__ == "__main__":
    main()
