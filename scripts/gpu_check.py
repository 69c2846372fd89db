"""The GPU check: lit-ess at a real model's shape on one accelerator, in one command (scripts/gpu_check.sh).

A Qwen2.5-0.5B-shaped model (its config: 24 layers, width 896, 14 heads / 2 kv heads, vocabulary
151,936, tied embeddings) with random weights, built here (nothing downloaded), trained in bf16 through
lit-ess's own PolicyModule and hf engine. It measures, per optimizer step (forward + backward + AdamW):

  train     tokens/s and peak GPU memory (above what the case started with) at 1k-, 4k- and 16k-token rows (8k or 16k tokens a micro-batch), with the
            chunked LM head (model.compute.logprob_chunk, default) and without it (null);
  fsdp2     the same step sharded by lit_ess.callbacks.FSDP2 over a 1-rank NCCL group (mixed precision
            bf16 params, fp32 reduce);
  lora      the step with LoRA adapters (rank 16, all linear layers) on the frozen base;
  ess       synchronous on-policy steps: the hf engine (bf16) samples, the trainer (bf16) trains one step,
            the weights go to the engine, and so on: the ESS of each step (1 in exact arithmetic; what bf16
            kernels of generate and of the training forward leave of it is the number).

It writes one JSON (default benchmarks/results/gpu_check.json, and a copy under $OUT when set) naming the
device. `--cpu` runs the same code at a tiny shape on this CPU (fp32, gloo), for the test suite.

    python scripts/gpu_check.py [--cpu] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from lit_ess.settings import Compute, MicroBatch, Optim

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864, vocab=151_936)
QWEN25_7B = dict(hidden_size=3584, num_layers=28, num_heads=28, intermediate_size=18944, vocab=152_064,
                 num_key_value_heads=4, tie_word_embeddings=False)
TINY = dict(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128, vocab=4096)


def build_model(folder: Path, shape: dict, dtype: torch.dtype, device=None) -> str:
    """A random model of the Qwen2.5 family at `shape`, with a BPE chat tokenizer (its ids index the first
    entries of the vocabulary), written to `folder`; initialised in `dtype` on `device` (a 7B model's
    initialisation on the CPU would take minutes)."""
    from transformers import Qwen2ForCausalLM

    from lit_ess.tiny import build_chat_tokenizer, family_config

    extra = {k: shape[k] for k in ("tie_word_embeddings",) if k in shape}
    cfg = family_config("qwen2.5", shape["vocab"], shape["hidden_size"], shape["num_layers"], shape["num_heads"],
                        shape["intermediate_size"], 4096 if shape is TINY else 32768,
                        num_key_value_heads=shape.get("num_key_value_heads", max(shape["num_heads"] // 7, 1)), **extra)
    tok = build_chat_tokenizer()
    cfg.eos_token_id, cfg.pad_token_id = tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device or "cpu"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.to(dtype).save_pretrained(folder)
    del model
    tok.save_pretrained(folder)
    return str(folder)


def synthetic_batch(rows: int, length: int, vocab: int, device):
    """`rows` rows of `length` tokens, the last 3/4 completion, behaviour logprobs near the policy's scale."""
    from lit_ess.sampling import SamplingConfig
    from lit_ess.batch import Row, collate

    g = torch.Generator().manual_seed(0)
    P = length // 4
    out = [Row(prompt=torch.randint(10, vocab, (P,), generator=g).tolist(),
               completion=torch.randint(10, vocab, (length - P,), generator=g).tolist(),
               logprobs=(-12.0 + 0.1 * torch.randn(length - P, generator=g)).tolist(),
               advantage=float(torch.randn((), generator=g)), reward=0.0, version=0, prompt_id=i,
               prompt_text="", completion_text="") for i in range(rows)]
    return collate(out, pad_id=0, sampling=SamplingConfig(temperature=1.0, max_new_tokens=length - P)).to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device) -> None:
    """Free what finished cases left: PolicyModule sits in reference cycles, so only a collection frees it."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def allocated_gib(device) -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None


def train_steps(module, batch, device, steps: int, shard=None) -> dict:
    """`steps` optimizer steps of `module` on `batch` after one warm-up: tokens/s, s/step, peak GPU memory."""
    from lit_ess.step import build_optimizer, clip_gradients

    free(device)
    before = allocated_gib(device)                   # what the case starts with (its batch, a 1-rank group)
    module.configure_model()
    module.policy.to(device)
    if shard is not None:
        shard(module)
    opt = build_optimizer(module.policy, 1e-6)
    tokens = int(batch.completion_mask.sum())

    def step():
        opt.zero_grad(set_to_none=True)
        metrics, ess = module.accumulate_gradients(batch)
        clip_gradients([p for p in module.policy.parameters() if p.requires_grad], 1.0)
        opt.step()
        return metrics

    step()
    peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics = step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    peak = peak_gib(device)
    return {"tokens_per_step": tokens, "s_per_step": dt, "tokens_per_s": tokens / dt, "loss": metrics["train/loss"],
            "peak_gib": None if peak is None else peak - before}


def write(results: dict, out: Path | None) -> None:
    """The JSON so far, to `out` and $OUT: written after every case, so a check stopped by its time limit still
    leaves what it measured."""
    text = json.dumps(results, indent=1) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)


def run_case(results: dict, name: str, fn, out: Path | None = None) -> None:
    """One measurement; a failure is recorded (one line and the traceback's tail) and the check goes on."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
        results[name]["wall_s"] = time.perf_counter() - t0
        print(f"  {name}: {json.dumps(results[name])}", flush=True)
    except Exception as e:                           # noqa: BLE001 -- recorded, the next case still runs
        results[name] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-1500:]}
        print(f"  {name}: FAILED {results[name]['error']}", flush=True)
    finally:
        free(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        write(results, out)


def one_rank_group(device):
    """A 1-rank process group (NCCL on a GPU, gloo on CPU) and its 1-D device mesh, for FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("data_parallel",))


def ess_steps(model_dir: str, device, dtype: str, steps: int, prompts: int, samples: int, new_tokens: int) -> dict:
    """Synchronous on-policy RL steps: hf engine (same dtype) samples, trainer trains one step, weights pushed."""
    from lit_ess.advantages import GroupMean
    from lit_ess.engines import HFConfig
    from lit_ess.sampling import SamplingConfig
    from lit_ess.module import PolicyModule
    from lit_ess.batch import Row, collate
    from lit_ess.step import build_optimizer

    engine = HFConfig(dtype=dtype, device=str(device), batch_size=prompts * samples).build(model_dir)
    m = PolicyModule(model_dir, compute=Compute(dtype=dtype), optim=Optim(lr=1e-5))
    m.configure_model()
    m.policy.to(device)
    opt = build_optimizer(m.policy, 1e-5)
    s = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        prompt_ids = [torch.randint(10, 1000, (8,), generator=g).tolist() for _ in range(prompts)]
        groups = engine.generate(prompt_ids, samples, s, call_seed=step)
        rewards = torch.tensor([[len(c.token_ids) % 3 / 2.0 for c in grp] for grp in groups])
        adv = GroupMean()(rewards)
        rows = [Row(prompt=p, completion=c.token_ids, logprobs=c.logprobs, advantage=float(adv[i, j]), reward=0.0,
                    version=step, prompt_id=i, prompt_text="", completion_text="")
                for i, (p, grp) in enumerate(zip(prompt_ids, groups)) for j, c in enumerate(grp)]
        batch = collate(rows, pad_id=engine.pad_id, sampling=s).to(device)
        opt.zero_grad(set_to_none=True)
        metrics, ess = m.accumulate_gradients(batch)
        opt.step()
        engine.load_weights(((k, v) for k, v in m.policy_weights()), step + 1)
        out.append({"step": step, "ess": float(ess), "tokens": int(batch.completion_mask.sum()),
                    "ratio_max": metrics.get("train/ratio_max"), "ratio_min": metrics.get("train/ratio_min")})
    return {"dtype": dtype, "steps": out, "ess_min": min(r["ess"] for r in out)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the same code at a tiny shape on this CPU (fp32)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_check.json; --cpu: none)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--large", action="store_true",
                    help="Qwen2.5-7B's shape instead: full fine-tuning at 2 x 4k and 1 x 16k tokens, LoRA at 2 x 4k, activation "
                         "checkpointing, chunked and full logits (writes gpu_check_7b.json)")
    a = ap.parse_args(argv)
    cpu = a.cpu or not torch.cuda.is_available()
    if not a.cpu and cpu:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): run with --cpu for the dry mode",
              file=sys.stderr)
        sys.exit(2)
    device = torch.device("cpu" if cpu else "cuda")
    shape, dtype = (TINY, "float32") if cpu else (QWEN25_7B if a.large else QWEN25_05B, "bfloat16")
    lengths = ({"1k": (8, 1024), "4k": (2, 4096), "16k": (1, 16384)} if not cpu else
               {"1k": (4, 64), "4k": (1, 256), "16k": (1, 512)})
    import lightning
    import transformers

    results: dict = {"check": "gpu_check", "mode": "cpu dry run" if cpu else "gpu",
                     "device": torch.cuda.get_device_name(0) if not cpu else f"cpu ({platform.processor() or platform.machine()})",
                     "versions": {"torch": torch.__version__, "lightning": lightning.__version__,
                                  "transformers": transformers.__version__, "python": platform.python_version(),
                                  "cuda": torch.version.cuda},
                     "model": {"family": "qwen2.5", **shape, "dtype": dtype}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(a.out) if a.out else (None if a.cpu else ROOT / "benchmarks" / "results" /
                                     ("gpu_check_7b.json" if a.large else "gpu_check.json"))
    print(f"gpu_check on {results['device']} ({results['mode']}), model {shape}", flush=True)
    t_start = time.perf_counter()
    from lit_ess.module import PolicyModule

    if a.large:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_model(Path(tmp) / "model", shape, getattr(torch, dtype), device)
            results["build_s"] = time.perf_counter() - t_start
            for label, name, kw in (("full_4k_chunked", "4k", {}), ("full_4k_unchunked", "4k", {"logprob_chunk": None}),
                                    ("lora_4k_chunked", "4k", {"lora": True}), ("full_16k_chunked", "16k", {}),
                                    ("full_16k_unchunked", "16k", {"logprob_chunk": None})):
                rows, length = lengths[name]
                batch = synthetic_batch(rows, length, shape["vocab"], device)

                def case(kw=kw, rows=rows, batch=batch):
                    from lit_ess.lora import LoRA

                    lora = {"lora": LoRA(rank=16)} if "lora" in kw else {}
                    chunk = {k: v for k, v in kw.items() if k == "logprob_chunk"}
                    compute = Compute(dtype=dtype, gradient_checkpointing=True, **chunk)
                    return train_steps(PolicyModule(model_dir, compute=compute, micro_batch=MicroBatch(size=rows), **lora),
                                       batch, device, a.steps)

                run_case(results, label, case, out)
                del batch
        results["wall_s"] = time.perf_counter() - t_start
        results["failed"] = sorted(k for k, v in results.items() if isinstance(v, dict) and "error" in v)
        write(results, out)
        print(f"gpu_check: {len(results['failed'])} failed {results['failed']}, {results['wall_s']:.0f} s", flush=True)
        return results

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", shape, getattr(torch, dtype))
        chunk = 64 if cpu else None                          # None: lit-ess's default chunk
        for name, (rows, length) in lengths.items():
            batch = synthetic_batch(rows, length, shape["vocab"], device)
            for label, c in (("chunked", chunk or "default"), ("unchunked", None)):
                head = {} if c == "default" else {"logprob_chunk": c}
                run_case(results, f"train_{name}_{label}", lambda: train_steps(
                    PolicyModule(model_dir, compute=Compute(dtype=dtype, **head), micro_batch=MicroBatch(size=rows)),
                    batch, device, a.steps), out)
        batch = synthetic_batch(*lengths["1k"], shape["vocab"], device)

        def fsdp2():
            from lit_ess.callbacks import FSDP2

            mesh = one_rank_group(device)
            sharder = FSDP2(param_dtype=None if cpu else "bfloat16", reduce_dtype="float32")
            m = PolicyModule(model_dir, compute=Compute(dtype="float32"), micro_batch=MicroBatch(size=lengths["1k"][0]))
            return train_steps(m, batch, device, a.steps, shard=lambda mod: sharder.shard(mod.policy, mesh))

        run_case(results, "fsdp2_1k", fsdp2, out)

        def lora():
            from lit_ess.lora import LoRA

            return train_steps(PolicyModule(model_dir, compute=Compute(dtype=dtype), micro_batch=MicroBatch(size=lengths["1k"][0]),
                                            lora=LoRA(rank=16)), batch, device, a.steps)

        run_case(results, "lora_1k", lora, out)
        run_case(results, "ess_sync", lambda: ess_steps(model_dir, device, dtype, steps=3, prompts=4 if cpu else 8,
                                                        samples=4, new_tokens=16 if cpu else 256), out)
    for name in lengths:
        c, u = results.get(f"train_{name}_chunked", {}), results.get(f"train_{name}_unchunked", {})
        if "tokens_per_s" in c and "tokens_per_s" in u:
            results[f"ratio_{name}"] = {"time": c["s_per_step"] / u["s_per_step"],
                                        "peak": (c["peak_gib"] / u["peak_gib"]) if c["peak_gib"] else None}
    results["wall_s"] = time.perf_counter() - t_start
    results["failed"] = sorted(k for k, v in results.items() if isinstance(v, dict) and "error" in v)
    write(results, out)
    if out is not None:
        print(f"wrote {out}")
    print(f"gpu_check: {len(results['failed'])} failed {results['failed']}, {results['wall_s']:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
