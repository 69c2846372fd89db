"""Make the README's pictures from a real demo run (run `bash scripts/demo.sh` first):

    docs/img/demo_reward.png     reward, held-out reward and ESS against step (matplotlib)
    docs/img/tensorboard.png     TensorBoard's Custom Scalars dashboard (headless chromium screenshot)

    .venv/bin/python scripts/readme_figures.py [--runs runs/demo] [--out docs/img]

--runs: the folder of the demo's run folders (each config's output_dir: rl/, rl_async/, sft/, ...); TensorBoard
shows each run under its folder's name.

Needs matplotlib (`pip install -e ".[docs]"`) and Debian's chromium (`apt-get install chromium`);
scripts/readme_figures.sh installs both.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lit_ess.report import first_last, read_scalars


def reward_plot(runs: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = read_scalars(runs / "rl" / "logs")
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1.2))
    steps, reward = zip(*s["rollout/reward_mean"])
    ax.plot(steps, reward, color="#1f77b4", alpha=0.35, lw=1, label="rollout/reward_mean (per step)")
    k = 10
    smooth = [sum(reward[max(0, i - k + 1):i + 1]) / len(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
    ax.plot(steps, smooth, color="#1f77b4", lw=2, label=f"rollout/reward_mean ({k}-step mean)")
    if "val/reward_mean" in s:
        vs, vr = zip(*s["val/reward_mean"])
        ax.plot(vs, vr, "o-", color="#d62728", label="val/reward_mean (128 held-out prompts)")
    first, last = first_last(list(reward))
    ax.set_title(f"lit-ess CPU demo: P3O on 2-digit addition (reward {first:.2f} -> {last:.2f})")
    ax.set_ylabel("sampled reward")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    es, ev = zip(*s["train/ess"])
    bx.plot(es, ev, color="#2ca02c", lw=1.5, label="train/ess")
    bx.set_ylim(min(0.99, min(ev) - 0.001), 1.0005)
    bx.set_ylabel("e_B")
    bx.set_xlabel("optimizer step")
    bx.legend(loc="lower right")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard_screenshot(runs: Path, out: Path, tab: str = "custom_scalars") -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("readme_figures: no chromium on PATH (apt-get install chromium)")
    port = _free_port()
    spec = ",".join(f"{d.name}:{d / 'logs'}" for d in sorted(runs.iterdir()) if (d / "logs").is_dir())   # run = folder name
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir_spec", spec, "--port", str(port),
                           "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(120):                                    # at most 60 s for TensorBoard to load the runs
            try:
                urllib.request.urlopen(url + "data/runs", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(3)
        subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1500,1100", "--virtual-time-budget=20000", f"--screenshot={out}",
                        f"{url}#{tab}"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        print(f"wrote {out}")
    finally:
        tb.terminate()
        tb.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="runs/demo")
    p.add_argument("--out", default="docs/img")
    a = p.parse_args(argv)
    runs, out = Path(a.runs), Path(a.out)
    if not (runs / "rl" / "logs").is_dir():
        sys.exit(f"readme_figures: {runs / 'rl' / 'logs'} not found: run `bash scripts/demo.sh` first")
    out.mkdir(parents=True, exist_ok=True)
    reward_plot(runs, out / "demo_reward.png")
    tensorboard_screenshot(runs, out / "tensorboard.png")


if __name__ == "__main__":
    main()
