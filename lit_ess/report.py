"""Read a run's TensorBoard event files and summarise it.

    python -m lit_ess.report runs/demo/rl/logs      (or the run's folder, runs/demo/rl)
prints, for the scalars that matter, the mean over the first and the last 10% of steps.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file under `logdir` (later files win on a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                out.setdefault(tag, {})[e.step] = e.value
    return {t: sorted(v.items()) for t, v in out.items()}


def read_histogram_tags(logdir: str | Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for f in Path(logdir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"histograms": 0})
        acc.Reload()
        tags |= set(acc.Tags()["histograms"])
    return tags


def read_texts(logdir: str | Path) -> dict[str, list[tuple[int, str]]]:
    """{tag: [(step, markdown), ...]} of the text summaries (TensorBoard's Text tab) under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, str]]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            if not tag.endswith("/text_summary"):       # other tensors hold binary plugin data
                continue
            for e in acc.Tensors(tag):
                if e.tensor_proto.string_val:
                    out.setdefault(tag, []).append((e.step, e.tensor_proto.string_val[0].decode()))
    return out


def first_last(values: list[float], frac: float = 0.1) -> tuple[float, float]:
    k = max(1, int(len(values) * frac))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logdir")
    a = p.parse_args(argv)
    scalars = read_scalars(a.logdir)
    if not scalars:
        raise SystemExit(f"no TensorBoard scalars under {a.logdir}")
    print(f"{'tag':32s} {'steps':>6s} {'first 10%':>10s} {'last 10%':>10s}")
    for tag in ["rollout/reward_mean", "train/ess", "train/kl_behavior", "train/capped_frac", "train/ratio_max",
                "rollout/response_len", "rollout/degenerate_frac", "train/loss", "rollout/gen_tokens_per_s"]:
        if tag in scalars:
            vals = [v for _, v in scalars[tag]]
            f, l_ = first_last(vals)
            print(f"{tag:32s} {len(vals):6d} {f:10.4f} {l_:10.4f}")


if __name__ == "__main__":
    main()
