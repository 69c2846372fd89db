"""Peak memory and time of one training step at a real vocabulary: chunked LM head against full logits.

The model is built from Qwen2.5's family config (lit_ess.tiny.family_config) with its real vocabulary,
151,936 tokens, and a small width and depth (default 2 layers of width 256, random weights, fp32), so the
LM head and its logits dominate as they do in a real model's training step. One step is what the
trainer's gradient pass does: `lit_ess.logprobs.sequence_logprobs` over a micro-batch of `--rows` rows
of `--tokens` tokens (the last 3/4 of each row is completion), a token-mean policy-gradient loss on the
logprobs (and the entropy), and backward. Each configuration runs in a fresh process (spawn); per step:

  peak:  the process's resident high-water mark (VmHWM) during the step, reset to the current RSS just
         before it (/proc/self/clear_refs 5), minus that RSS: what the step adds over the model and the
         runtime; the largest over the rounds.
  time:  wall seconds of forward + backward. The settings compared share one process and one model and
         take turns, step by step (one warm-up step each, then `--steps` rounds, the order alternating):
         the ratio is the median of the rounds' paired ratios, robust to the load of a shared machine.

Configurations: chunked (model.compute.logprob_chunk, default lit_ess.logprobs.DEFAULT_CHUNK) against unchunked
(logprob_chunk: null, the model's full logits of the completion span), each with activation
checkpointing (gradient_checkpointing) off and on; then chunked and unchunked against the row length at
the fixed chunk, and the chunk size at the benchmark's row length. Ratios are within one run.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/logprob_memory.py [--quick]

Writes benchmarks/results/logprob_memory.json (--quick: a small shape, for the suite; nothing written
unless --out is given).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).parent / "results" / "logprob_memory.json"
QWEN25_VOCAB = 151_936


def _kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _reset_peak() -> int:
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS")


def _worker(cfg: dict, out) -> None:
    """One model and micro-batch; for each round, one step with each chunk setting of cfg["chunks"], in an
    order that alternates between rounds (the machine's load drifts; paired steps cancel most of it)."""
    from lit_ess.logprobs import sequence_logprobs
    from lit_ess.tiny import family_config
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = family_config("qwen2.5", cfg["vocab"], cfg["hidden"], cfg["layers"], cfg["hidden"] // 64,
                           cfg["hidden"] * 3, max(cfg["tokens"], 256))
    model = Qwen2ForCausalLM(config).train()
    if cfg["checkpointing"]:
        model.gradient_checkpointing_enable()
    B, L = cfg["rows"], cfg["tokens"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (B, L), generator=g)
    att = torch.ones_like(ids)
    comp = torch.zeros(B, L, dtype=torch.bool)
    comp[:, L // 4:] = True
    adv = torch.randn(B, 1, generator=g)

    def step(chunk) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        base = _reset_peak()
        t0 = time.perf_counter()
        lp, _ = sequence_logprobs(model, ids, att, comp, temperature=0.9, chunk=chunk)
        (-(lp * adv * comp).sum() / comp.sum()).backward()
        return (_kib("VmHWM") - base) / 1024, time.perf_counter() - t0

    chunks = cfg["chunks"]
    for c in chunks:                            # warm-up: allocator, first calls
        step(c)
    res = {str(c): {"peak_mib": [], "time_s": []} for c in chunks}
    for r in range(cfg["steps"]):
        for c in (chunks if r % 2 == 0 else chunks[::-1]):
            peak, dt = step(c)
            res[str(c)]["peak_mib"].append(peak)
            res[str(c)]["time_s"].append(dt)
    out.put({**cfg, "by_chunk": {c: {"peak_mib": max(v["peak_mib"]), "time_s": statistics.median(v["time_s"]),
                                     "peaks_mib": v["peak_mib"], "times_s": v["time_s"]} for c, v in res.items()}})


def measure(cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(cfg, q))
    p.start()
    while True:
        try:
            res = q.get(timeout=5)
            break
        except Exception:                       # queue.Empty: is the worker still there?
            if not p.is_alive():
                raise RuntimeError(f"the worker of {cfg} ended with exit code {p.exitcode} before reporting "
                                   f"(-9: killed, e.g. out of memory)") from None
    p.join()
    return res


def main(argv=None) -> dict:
    from lit_ess.logprobs import DEFAULT_CHUNK

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    ap.add_argument("--steps", type=int, default=3, help="rounds of paired steps")
    ap.add_argument("--lengths", default="512,1024,2048,4096", help="row lengths of the length sweep")
    ap.add_argument("--max-unchunked", type=int, default=2048,
                    help="longest row of the length sweep run unchunked (4,096 unchunked needs ~20 GB here)")
    ap.add_argument("--chunks", default="256,4096", help="chunk sizes of the chunk sweep (beside --chunk)")
    ap.add_argument("--quick", action="store_true", help="a small shape (vocab 4,096, 256-token rows), for the suite")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.vocab, a.tokens, a.hidden, a.layers, a.chunk, a.steps = 4096, 256, 64, 1, 64, 2
        a.lengths, a.chunks = "128,256", "32"
    out = Path(a.out) if a.out else (None if a.quick else RESULTS)
    base = dict(rows=a.rows, tokens=a.tokens, hidden=a.hidden, layers=a.layers, vocab=a.vocab, steps=a.steps,
                checkpointing=False)
    runs: dict[str, list[dict]] = {"main": [], "lengths": [], "chunks": []}

    def run(group: str, **cfg) -> dict:
        r = measure({**base, **cfg})
        runs[group].append(r)
        for c, v in r["by_chunk"].items():
            print(f"  {group:8s} chunk {c:>5s} checkpointing {str(r['checkpointing']):5s} rows {r['rows']} x "
                  f"{r['tokens']:5d}: peak {v['peak_mib']:8.1f} MiB, {v['time_s']:7.2f} s (median of {len(v['times_s'])})",
                  flush=True)
        return r

    print(f"Qwen2.5 family, vocabulary {a.vocab:,}, width {a.hidden}, {a.layers} layers, {a.rows} rows x {a.tokens} "
          f"tokens, chunk {a.chunk}", flush=True)
    ratios = {}
    for ckpt in (False, True):
        r = run("main", chunks=[a.chunk, None], checkpointing=ckpt)
        c, u = r["by_chunk"][str(a.chunk)], r["by_chunk"]["None"]
        paired = [x / y for x, y in zip(c["times_s"], u["times_s"])]
        ratios[f"checkpointing_{ckpt}"] = {"peak": c["peak_mib"] / u["peak_mib"], "time": statistics.median(paired),
                                           "time_paired": paired}
    for n in map(int, a.lengths.split(",")):
        if n != a.tokens:
            run("lengths", chunks=[a.chunk, None] if n <= a.max_unchunked else [a.chunk], tokens=n)
    run("chunks", chunks=[int(c) for c in a.chunks.split(",")] + [a.chunk])
    for k, v in ratios.items():
        print(f"chunked / unchunked, {k}: peak {v['peak']:.3f} (goal <= 0.3), time {v['time']:.3f} (goal <= 1.15; "
              f"median of the paired rounds)")
    result = {"benchmark": "logprob_memory", "device": "cpu (this 2-core machine, 1 thread)", "torch": torch.__version__,
              "shape": {k: v for k, v in base.items() if k != "checkpointing"} | {"chunk": a.chunk},
              "ratios_chunked_over_unchunked": ratios, "runs": runs}
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
