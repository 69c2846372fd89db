"""LoRA against full fine-tuning on one model, ratios within this run:

1. Checkpoint bytes: what PolicyModule puts in a checkpoint's state dict (the adapters only with LoRA)
   plus the AdamW state after one optimizer step, against the same for full fine-tuning.
2. Weight sync seconds per push to the in-process vLLM engine, `lora.sync: merged` (W + sBA for every
   weight, `reload_weights`) against `lora.sync: adapter` (A and sB written as a peft folder on
   /dev/shm, loaded in place by vLLM at the next request). A push is not finished until the engine
   samples with it, so each push is timed together with one 1-token request, and that request alone
   is timed too and reported beside it.

    .venv/bin/python benchmarks/lora.py [--hidden-size 512 --num-layers 8 --rank 16 --pushes 10]

The default model is the 25M-parameter size of the other benchmarks (width 512, 8 layers). Writes
benchmarks/results/lora.json.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def nbytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def checkpoint_bytes(model_dir: str, lora) -> dict:
    """Bytes of the module's checkpointed weights and of the optimizer state after one step."""
    from lit_ess.module import PolicyModule

    m = PolicyModule(model_dir, lora=lora)
    m.configure_model()
    opt = m.configure_optimizers()["optimizer"]
    x = torch.randint(0, 100, (2, 16))
    m.policy(x).logits.mean().backward()
    opt.step()
    ckpt = {"state_dict": m.state_dict()}             # with LoRA, the adapters only
    trainable = sum(p.numel() for p in m.policy.parameters() if p.requires_grad)
    return {"weights_bytes": nbytes(ckpt["state_dict"]), "optimizer_bytes": nbytes(opt.state_dict()),
            "trainable_params": trainable}


def sync_seconds(model_dir: str, rank: int, pushes: int) -> dict:
    """Median seconds of (push + a 1-token request) and of the request alone, for both sync modes."""
    from lit_ess.engines import VLLMConfig
    from lit_ess.sampling import SamplingConfig
    from lit_ess.lora import LoRA
    from lit_ess.module import PolicyModule

    engine = VLLMConfig(max_lora_rank=rank).build(model_dir)
    modules = {}
    for sync in ("merged", "adapter"):
        m = PolicyModule(model_dir, lora=LoRA(rank=rank, sync=sync))
        m.configure_model()
        for n, p in m.policy.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.02)                  # a trained-looking adapter (B = 0 at init)
        modules[sync] = m
    one = SamplingConfig(max_new_tokens=1, seed=0)
    prompts = [[1, 2, 3, 4]]
    times = {s: {"push_and_request": [], "request": [], "bytes": 0} for s in modules}
    version = 0
    for i in range(pushes + 1):                          # the first round warms both paths up
        for sync, m in modules.items():
            version += 1
            if sync == "merged":
                engine.lora_request = None               # the merged model is served without an adapter
            t0 = time.perf_counter()
            weights = list(m.policy_weights())
            engine.load_weights(iter(weights), version)
            engine.generate(prompts, 1, one)
            t1 = time.perf_counter()
            engine.generate(prompts, 1, one)
            t2 = time.perf_counter()
            if i:
                times[sync]["push_and_request"].append(t1 - t0)
                times[sync]["request"].append(t2 - t1)
            times[sync]["bytes"] = sum(t.numel() * t.element_size() for _, t in weights)
    return {s: {"push_and_request_s": statistics.median(v["push_and_request"]),
                "request_s": statistics.median(v["request"]), "pushed_bytes": v["bytes"]} for s, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora.json"))
    a = p.parse_args()

    from lit_ess.lora import LoRA
    from lit_ess.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        heads = a.hidden_size // 64                      # the shape of the other benchmarks' 25M model
        model_dir = str(build_tiny_model(Path(tmp) / "model", hidden_size=a.hidden_size, num_layers=a.num_layers,
                                         num_heads=heads, num_kv_heads=heads, intermediate_size=3 * a.hidden_size))
        n_params = sum(t.numel() for t in __import__("transformers").AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        full, lora = checkpoint_bytes(model_dir, None), checkpoint_bytes(model_dir, LoRA(rank=a.rank))
        sync = sync_seconds(model_dir, a.rank, a.pushes)
    result = {
        "command": f"python benchmarks/lora.py --hidden-size {a.hidden_size} --num-layers {a.num_layers} "
                   f"--rank {a.rank} --pushes {a.pushes}",
        "params": n_params, "rank": a.rank, "full": full, "lora": lora, "sync": sync,
        "ratios": {
            "checkpoint_weights_lora_over_full": lora["weights_bytes"] / full["weights_bytes"],
            "optimizer_state_lora_over_full": lora["optimizer_bytes"] / full["optimizer_bytes"],
            "sync_adapter_over_merged": sync["adapter"]["push_and_request_s"] / sync["merged"]["push_and_request_s"],
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
