"""The page's intervals: Wilson for collapse counts, a seeded percentile bootstrap for means over seeds,
and the test the page uses to call a difference resolved (the two 95% intervals do not overlap)."""
from __future__ import annotations

import math
import random

Z95 = 1.959964                        # the standard normal's 97.5% quantile: two-sided 95% intervals
RESAMPLES, BOOT_SEED = 10_000, 0      # the bootstrap's resamples, and its RNG's fixed seed (a reproducible page)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a rate k/n (95% at z = 1.96): center (k + z^2/2) / (n + z^2), half-width
    z / (n + z^2) * sqrt(k (n - k) / n + z^2 / 4). Unlike k/n +- z sqrt(p(1-p)/n) it is not empty at 0/n or n/n."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"wilson: need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    center = (k + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_mean(xs: list[float], resamples: int = RESAMPLES, seed: int = BOOT_SEED,
                   level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: `resamples` means of n values drawn with replacement
    (random.Random(seed)), sorted; the bounds are the ceil(B a)-th and ceil(B (1 - a))-th, a = (1 - level)/2.
    With n = 3 every extreme resample (all three draws the same seed) has probability 1/27 > 2.5%, so the
    interval is the seeds' min..max."""
    if not xs:
        raise ValueError("bootstrap_mean: no values")
    rng, n = random.Random(seed), len(xs)
    means = sorted(sum(rng.choices(xs, k=n)) / n for _ in range(resamples))
    a = (1 - level) / 2
    return means[math.ceil(resamples * a) - 1], means[math.ceil(resamples * (1 - a)) - 1]


def apart(a: tuple[float, float], b: tuple[float, float]) -> int:
    """+1 when interval a lies wholly above b, -1 wholly below, 0 when they overlap (not resolved).
    Non-overlap of two 95% intervals is a conservative test: overlapping ones may still differ."""
    return 1 if a[0] > b[1] else -1 if a[1] < b[0] else 0
