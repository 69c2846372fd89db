"""One RL iteration, top to bottom: the loop lit-ess runs, in plain PyTorch, in one process.

    prompts     P prompts in the data module's order (PromptOrder), tokenized as it does (encode_prompt)
    rollout     the engine samples n completions per prompt and returns log pi_b of every sampled token
    rewards     the reward scorer; group advantages A = (r - mean(r)) / std(r) over each prompt's n samples
    batch       the P x n rows collated into a RolloutBatch: [B, T] tensors, B = P n
    loss        lp = log pi_theta [B, T] at the engine's temperature, e_B, the objective (P3O by default)
    update      backward, clip ||g|| to max_grad_norm, AdamW step at lr * lr_factor(step)
    weight push the new weights go to the engine, which samples the next step's rollout

This is `lit-ess fit` in sync mode on one device with one micro-batch per step, built from the same
pieces (tests/test_reference.py runs both on the same seed and compares their losses). What `fit` adds
around it: micro-batches and data-parallel ranks (PolicyModule.accumulate_gradients), asynchronous
rollouts and the staleness bound (RolloutDataModule), checkpoints, validation, logging.

    python -m lit_ess.reference --model_path runs/demo/sft/model --steps 20 --lr 2e-4 --max_new_tokens 8

prints one JSON line per step: loss, reward_mean, ess, grad_norm.
"""
from __future__ import annotations

import argparse
import json

from lit_ess.console import quiet_console

quiet_console()            # before transformers and vLLM are imported

import torch  # noqa: E402

from lit_ess.advantages import GroupMean  # noqa: E402
from lit_ess.batch import Row, collate  # noqa: E402
from lit_ess.datamodules.prompts import Arithmetic, PromptOrder, encode_prompt  # noqa: E402
from lit_ess.engines import HFConfig, VLLMConfig  # noqa: E402
from lit_ess.knobs import check  # noqa: E402
from lit_ess.logprobs import sequence_logprobs  # noqa: E402
from lit_ess.objectives import OBJECTIVE_CLASSES, batch_ess  # noqa: E402
from lit_ess.rewards import RewardScorer  # noqa: E402
from lit_ess.sampling import SamplingConfig  # noqa: E402
from lit_ess.step import build_optimizer, clip_gradients, disable_dropout, finite_mask, full_weights, lr_factor  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_path", required=True, help="Hugging Face causal-LM folder (e.g. from lit-ess-tiny)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps, one rollout each")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (P)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (n, the group size)")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--objective", default="P3O", choices=[c.__name__ for c in OBJECTIVE_CLASSES],
                   help="a class of lit_ess.objectives, with its default hyper-parameters")
    p.add_argument("--reward", default="exact_match", help="exact_match, gsm8k, math_verify or module:function")
    p.add_argument("--size", type=int, default=10_000, help="examples of the Arithmetic prompt source (2 digits, +)")
    p.add_argument("--engine", default="VLLMConfig", choices=["VLLMConfig", "HFConfig"], help="the engine's config class")
    p.add_argument("--seed", type=int, default=0, help="prompt order, sampling seeds, torch")
    args = p.parse_args(argv)
    check("--max_grad_norm", args.max_grad_norm, gt=0)      # before the model and engine load, not at step 1

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).train()
    disable_dropout(policy)                     # else on-policy tokens score rho != 1
    optimizer = build_optimizer(policy, args.lr)
    objective = next(c for c in OBJECTIVE_CLASSES if c.__name__ == args.objective)()
    engine = {"VLLMConfig": VLLMConfig, "HFConfig": HFConfig}[args.engine]().build(args.model_path)
    scorer = RewardScorer(args.reward)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    source = Arithmetic(size=args.size)
    order = PromptOrder(len(source), args.seed)
    P, n, history, updates = args.prompts, args.samples, [], 0       # updates: optimizer steps taken

    for step in range(args.steps):
        # rollout: P prompts x n samples; request seeds derive from (seed, step, prompt position, sample)
        examples = [source.examples[i] for i in order.take(P)]
        prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
        groups = engine.generate(prompts, n, sampling, call_seed=step)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
        rewards = torch.tensor(scorer(texts, [ex.answer for ex in examples for _ in range(n)])).view(P, n)
        adv = GroupMean()(rewards)                                               # [P, n]
        rows = [Row(prompt=prompts[i], completion=c.token_ids, logprobs=c.logprobs, advantage=float(adv[i, j]),
                    reward=float(rewards[i, j]), version=step, prompt_id=i, prompt_text=examples[i].prompt,
                    completion_text=texts[i * n + j]) for i, g in enumerate(groups) for j, c in enumerate(g)]
        b = collate(rows, pad_id)                                                # [B, T] tensors

        # loss: log pi_theta of the sampled tokens, processed as the engine sampled them
        lp, _ = sequence_logprobs(policy, b.input_ids, b.attention_mask, b.completion_mask,
                                  sampling.temperature, sampling.top_k, sampling.top_p)           # [B, T]
        ess = batch_ess(lp - b.behavior_logprobs, finite_mask(b.completion_mask, b.behavior_logprobs, lp))
        mask = b.completion_mask                                                 # [B, T] bool
        out = objective(lp, b.behavior_logprobs, b.advantages, mask, ess=ess,
                        num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum(), norm_len=sampling.max_new_tokens)

        # update: one AdamW step with the clipped gradient (a non-finite gradient norm skips the step)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(updates, args.warmup_steps)
        out.loss.backward()
        grad_norm = clip_gradients(policy.parameters(), args.max_grad_norm)
        if torch.isfinite(grad_norm):
            optimizer.step()
            updates += 1
        optimizer.zero_grad(set_to_none=True)

        # weight push: the engine samples the next step with the new weights
        if step + 1 < args.steps:
            engine.load_weights(full_weights(policy), version=step + 1)
        history.append({"step": step, "loss": float(out.loss.detach()), "reward_mean": float(rewards.mean()),
                        "ess": float(ess), "grad_norm": float(grad_norm)})
        print(json.dumps(history[-1]), flush=True)

    scorer.close()
    engine.close()
    return history


if __name__ == "__main__":
    main()
