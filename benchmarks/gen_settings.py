"""Generation alone: transformers `generate` against vLLM under a few engine settings, in one process.

The same prompts (2-digit addition, `Arithmetic(digits=2, size=10000, seed=0)`), sampling (temperature
1.0, seeded) and shapes as benchmarks/vs_trl.py:

* `demo`: 32 prompts x 8 samples x 8 new tokens on the 1.8M-parameter `lit_ess.tiny` default model;
* `long`: 16 prompts x 8 samples x 64 new tokens on vs_trl's 14.3M-parameter `long` model.

Settings: `hf` (HFConfig), `vllm before` (KV blocks of 128 tokens, the CPU backend's default, and vLLM
detokenizing every step), `vllm blocks 128` (no detokenization), `vllm
default` (VLLMConfig(): blocks of 32, no detokenization). All engines live in this one process and
generate in turn, --rounds times, so a busy phase of the machine hits them all. Reported per setting:
the median wall seconds and the median CPU seconds of the process (with OMP_NUM_THREADS=1, the work
done, whatever other jobs hold the cores), and ratios to `hf`.

    .venv/bin/python benchmarks/gen_settings.py [--rounds 3] [--out benchmarks/results/gen_settings.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {   # name: (engine, VLLMConfig/HFConfig kwargs, vLLM detokenizes)
    "hf": ("hf", {}, False),
    "vllm before (blocks 128, detokenize)": ("vllm", {"vllm_kwargs": {"block_size": 128}}, True),
    "vllm blocks 128": ("vllm", {"vllm_kwargs": {"block_size": 128}}, False),
    "vllm default (blocks 32)": ("vllm", {}, False),
}


def measure(model: str, prompts: int, samples: int, new_tokens: int, rounds: int) -> dict:
    from transformers import AutoTokenizer

    from lit_ess.datamodules import Arithmetic
    from lit_ess.datamodules.prompts import encode_prompt
    from lit_ess.engines import HFConfig, VLLMConfig
    from lit_ess.sampling import SamplingConfig

    tok = AutoTokenizer.from_pretrained(model)
    ps = [encode_prompt(tok, e.prompt) for e in Arithmetic(digits=2, size=10000, seed=0).examples[:prompts]]
    s = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    engines = {}
    for name, (kind, kw, _) in SETTINGS.items():
        engines[name] = (VLLMConfig if kind == "vllm" else HFConfig)(**kw).build(model)
        engines[name].generate(ps[:4], 2, s)                           # warm-up
    import vllm                                 # after the engines: lit-ess sets vLLM's environment first

    plain = vllm.SamplingParams

    def detokenizing(**k):                                              # `vllm before`: vLLM detokenizes
        return plain(**{**k, "detokenize": True})

    wall, cpu, tokens = ({n: [] for n in engines} for _ in range(3))
    for r in range(rounds):
        for name, e in engines.items():
            vllm.SamplingParams = detokenizing if SETTINGS[name][2] else plain
            t0, c0 = time.perf_counter(), time.process_time()
            groups = e.generate(ps, samples, s, call_seed=r + 1)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            vllm.SamplingParams = plain
            tokens[name].append(sum(len(c.token_ids) for g in groups for c in g))
    hf_wall, hf_cpu = statistics.median(wall["hf"]), statistics.median(cpu["hf"])
    return {n: {"wall_s_median": statistics.median(wall[n]), "cpu_s_median": statistics.median(cpu[n]),
                "wall_vs_hf": statistics.median(wall[n]) / hf_wall, "cpu_vs_hf": statistics.median(cpu[n]) / hf_cpu,
                "tokens_mean": statistics.mean(tokens[n]), "wall_s": wall[n], "cpu_s": cpu[n]} for n in engines}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=["demo", "long"], help="one shape (default: both, each in its own process)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/gen_settings.json")
    a = p.parse_args(argv)
    if a.shape:
        sys.path.insert(0, str(ROOT))
        from benchmarks.vs_trl import LONG_MODEL, SHAPES
        from lit_ess.tiny import build_tiny_model

        with tempfile.TemporaryDirectory() as d:
            model = build_tiny_model(Path(d) / "m", **(LONG_MODEL if a.shape == "long" else {}))
            sh = SHAPES[a.shape]
            res = measure(str(model), sh["prompts"], sh["samples"], sh["new_tokens"], a.rounds)
        print(json.dumps({"shape": a.shape, "batch": [sh["prompts"], sh["samples"], sh["new_tokens"]],
                          "model": LONG_MODEL if a.shape == "long" else "lit_ess.tiny default", "settings": res}))
        return
    import subprocess

    command = "python benchmarks/gen_settings.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "rounds": a.rounds, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "load_average_start": os.getloadavg(), "shapes": {}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for shape in ("demo", "long"):            # vLLM engines cannot be torn down: one process per shape
        out = subprocess.run([sys.executable, __file__, "--shape", shape, "--rounds", str(a.rounds)], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"gen_settings: shape {shape} failed:\n{out.stderr[-3000:]}")
        j = json.loads(out.stdout.strip().splitlines()[-1])
        result["shapes"][shape] = j
        print(f"{shape} ({' x '.join(map(str, j['batch']))}):")
        for name, r in j["settings"].items():
            print(f"  {name:38s} wall {r['wall_s_median']:7.3f} s ({r['wall_vs_hf']:.2f}x hf)  "
                  f"cpu {r['cpu_s_median']:7.3f} s ({r['cpu_vs_hf']:.2f}x hf)  {r['tokens_mean']:.0f} tokens")
    result["load_average_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
