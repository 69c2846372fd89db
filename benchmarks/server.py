"""vLLM's own server as the rollout engine against the in-process engine, in one process, at the demo's
shape (32 prompts x 8 samples, <= 8 new tokens, fp32): start-up seconds, seconds per generate call
(the two engines alternate, `--rounds` calls each, the median kept) and seconds per weight update.
Server and client share the machine's cores, as they do in configs/demo_server.yaml.

    .venv/bin/python benchmarks/server.py [--model runs/demo/sft] [--rounds 5] [--out benchmarks/results/server.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: the tiny model, built in a temp folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ess.engines import SamplingConfig, VLLMConfig, VLLMServerConfig

    model = args.model or str(__import__("lit_ess.tiny", fromlist=["x"]).build_tiny_model(Path(tempfile.mkdtemp()) / "m"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(f"{10 + 3 * i}+{20 + 7 * i}=")["input_ids"] for i in range(args.prompts)]
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0)

    t0 = time.perf_counter()
    server = VLLMServerConfig(max_model_len=256).build(model)
    server_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = VLLMConfig(max_model_len=256).build(model)
    local_start = time.perf_counter() - t0

    gen = {"server": [], "in_process": []}
    for r in range(args.rounds + 1):                                  # round 0 warms both up, not kept
        for name, engine in (("server", server), ("in_process", local)):
            t0 = time.perf_counter()
            engine.generate(prompts, args.samples, s, call_seed=r)
            if r:
                gen[name].append(time.perf_counter() - t0)

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    update = {"server": [], "in_process": []}
    for v in range(1, args.rounds + 1):
        with torch.no_grad():
            for q in hf.parameters():
                q.add_(1e-3 * torch.randn_like(q))
        for name, engine in (("server", server), ("in_process", local)):
            t0 = time.perf_counter()
            engine.load_weights(hf.state_dict().items(), version=v)
            update[name].append(time.perf_counter() - t0)
    server.close()

    med = {k: {name: statistics.median(xs) for name, xs in d.items()} for k, d in (("generate", gen), ("update", update))}
    result = {"model": model, "shape": f"{args.prompts}x{args.samples}, <= 8 new tokens", "rounds": args.rounds,
              "start_seconds": {"server": server_start, "in_process": local_start},
              "generate_seconds_median": med["generate"], "update_seconds_median": med["update"],
              "generate_ratio_server_over_in_process": med["generate"]["server"] / med["generate"]["in_process"],
              "generate_seconds_all": gen, "update_seconds_all": update}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
