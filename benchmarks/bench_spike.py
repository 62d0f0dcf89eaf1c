"""False positives and detection power of the loss-spike detector (``detect.spike``) on
synthetic loss curves, the detector before the fix and now side by side, default policy.

    python benchmarks/bench_spike.py            # about 15 s on one core
    python benchmarks/bench_spike.py --seeds 20 # more runs per case

Healthy curves (false positives: a run counts once however often it fires): exponential
decays, power laws ``a + b (t + t0)^-alpha`` like language-model curves, and curves under a
cosine LR schedule (the loss follows the LR's running sum, so it flattens as the LR ends),
each with white, heteroscedastic (noise proportional to the loss above its floor) and
slightly autocorrelated (AR(1), phi 0.3) noise at several levels, over 60 and 300 steps.

Spikes (power: detected at the step, or for a climb within its 10 steps): one-step jumps of
8 to 30 times the noise, and of 5% and 20% of the loss, early (3 steps after min_history)
and late; and a sustained blow-up, the loss climbing by 1 or 3 noise units a step. An
oracle that knows the healthy curve and its noise (7 sd above it) gives the ceiling. Fully
deterministic (seeded per run). Results and their reading: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.detect import SpikeBar, SpikeDetector
from orchestrator.policy_sections import SpikePolicy

Curve = Callable[[int], float]


class LegacySpikeDetector:
    """The detector before the fix (copied): the reference extrapolated along the window's
    median step-to-step change, the noise from the window's changes around it."""

    def __init__(self, policy: SpikePolicy) -> None:
        self.policy = policy
        self.history: dict[str, deque[tuple[int, float]]] = {
            m: deque(maxlen=policy.window) for m in policy.metrics
        }

    def check(self, values: dict[str, float], step: int = 0) -> SpikeBar | None:
        for m, hist in self.history.items():
            x = values[m]
            if len(hist) >= self.policy.min_history and math.isfinite(x):
                bar = self._bar(m, [v for _, v in hist])
                if bar.exceeded(x, 1.0):
                    return bar
        for m, hist in self.history.items():
            if math.isfinite(values[m]):
                hist.append((step, values[m]))
        return None

    def _bar(self, metric: str, h: list[float]) -> SpikeBar:
        k = self.policy.reference_steps
        changes = sorted(b - a for a, b in itertools.pairwise(h))
        trend = min(changes[len(changes) // 2], 0.0)
        recent = sorted(h[-k:])
        ref = recent[len(recent) // 2] + trend * (k + 1) / 2
        spread = sorted(abs(c - trend) for c in changes)
        noise = 1.4826 * spread[len(spread) // 2] / math.sqrt(2)
        noise = max(noise, 1e-3 * abs(ref), 1e-12)
        return SpikeBar(metric, ref, noise, self.policy.zscore)


# --- healthy curves -------------------------------------------------------------------------
def cosine_progress(n: int, warmup: int) -> list[float]:
    """The running sum of a linear-warmup + cosine LR schedule, scaled to end at 1."""
    lr = [
        (t + 1) / warmup
        if t < warmup
        else 0.5 * (1 + math.cos(math.pi * (t - warmup) / (n - warmup)))
        for t in range(n)
    ]
    s = list(itertools.accumulate(lr))
    return [v / s[-1] for v in s]


def shapes(n: int) -> Iterator[tuple[str, Curve, float]]:
    """(family, mean loss at step t, its floor) of healthy runs, floors like the demo's."""
    for tau in (3, 10, 30, 100):
        yield "exp", lambda t, tau=tau: 2.8 + 8.0 * math.exp(-t / tau), 2.8
    for alpha, t0 in ((0.3, 1), (0.5, 1), (1.0, 1), (0.5, 10), (1.0, 10)):
        yield "power", lambda t, a=alpha, t0=t0: 2.0 + 9.0 * ((t + t0) / t0) ** -a, 2.0
    for warmup, speed in ((0, 5.0), (n // 10, 5.0), (n // 10, 20.0)):
        prog = cosine_progress(n, max(warmup, 1))
        yield "cosine", lambda t, p=prog, s=speed: 2.8 + 8.0 * (1 + s * p[t]) ** -0.7, 2.8


NOISES = ("white", "hetero", "ar")


def noisy(
    mean: Curve, floor: float, n: int, kind: str, sigma: float, rng: random.Random
) -> list[float]:
    """``sigma`` is the noise at the floor for white and AR(1) noise; heteroscedastic noise
    is ``sigma * (1 + 3 (loss - floor))``: noisier early, like a real loss."""
    out, e = [], 0.0
    for t in range(n):
        m = mean(t)
        if kind == "white":
            e = rng.gauss(0.0, sigma)
        elif kind == "hetero":
            e = rng.gauss(0.0, sigma * (1 + 3 * (m - floor)))
        else:
            e = 0.3 * e + rng.gauss(0.0, sigma * math.sqrt(1 - 0.09))
        out.append(m + e)
    return out


def fires(make: Callable[[], object], series: list[float], stop: int | None = None) -> list[int]:
    det = make()
    hits = []
    for t, x in enumerate(series[:stop]):
        if det.check({"loss": x}, t) is not None:  # type: ignore[attr-defined]
            hits.append(t)
    return hits


SIGMAS = (0.001, 0.005, 0.02, 0.05, 0.1)


def false_positives(make: Callable[[], object], seeds: int) -> dict[tuple[str, int], list[int]]:
    """(family, steps) -> [runs that fired, runs]; also '(all)'."""
    out: dict[tuple[str, int], list[int]] = {}
    for n in (60, 300):
        for family, mean, floor in shapes(n):
            for kind, sigma, s in itertools.product(NOISES, SIGMAS, range(seeds)):
                rng = random.Random(f"{family}{n}{kind}{sigma}{s}{mean(0)}{mean(30)}")
                hit = bool(fires(make, noisy(mean, floor, n, kind, sigma, rng)))
                for key in ((family, n), ("(all)", n)):
                    row = out.setdefault(key, [0, 0])
                    row[0] += hit
                    row[1] += 1
    return out


# --- spikes ---------------------------------------------------------------------------------
JUMPS = ("8x", "10x", "15x", "30x", "5%", "20%")
CLIMBS = ("climb 1x/step", "climb 3x/step")


@dataclass
class Power:
    hit: int = 0
    runs: int = 0
    delay: int = 0  # steps from a climb's start to its detection, summed over hits

    def __str__(self) -> str:
        return f"{100 * self.hit / max(self.runs, 1):5.1f}%"


@dataclass
class Case:
    when: str
    series: list[float]
    at: int  # the spike's step
    means: list[float]  # the healthy curve, for the oracle
    sds: list[float]  # the noise's standard deviation per step


class Oracle:
    """Knows the healthy curve and its noise: a spike is a value 7 sd above the curve. The
    ceiling for any detector that sees only the values (it needs no history)."""

    def __init__(self, case: Case) -> None:
        self.case = case

    def check(self, values: dict[str, float], step: int = 0) -> object | None:
        c = self.case
        return True if values["loss"] - c.means[step] > 7.0 * c.sds[step] else None


def spike_cases(seeds: int) -> Iterator[Case]:
    """Every healthy shape with a spike early (3 steps after min_history) or late."""
    for n, when, at in ((60, "early", 23), (300, "early", 23), (300, "late", 150)):
        for family, mean, floor in shapes(n):
            for kind, sigma, s in itertools.product(("white", "hetero"), SIGMAS[1:4], range(seeds)):
                rng = random.Random(f"spike{family}{n}{kind}{sigma}{s}{mean(0)}{mean(30)}")
                means = [mean(t) for t in range(at + 10)]
                hetero = kind == "hetero"
                sds = [sigma * (1 + 3 * (m - floor)) if hetero else sigma for m in means]
                # Early spikes split by whether the loss still falls faster than its noise.
                steep = means[at - 1] - means[at] > sds[at]
                label = f"{when}, {'falling' if steep else 'flat'}" if when == "early" else when
                yield Case(label, noisy(mean, floor, at + 10, kind, sigma, rng), at, means, sds)


def power(make: Callable[[Case], object], seeds: int) -> dict[tuple[str, str], Power]:
    out: dict[tuple[str, str], Power] = {}
    for case in spike_cases(seeds):
        at, sd = case.at, case.sds[case.at]
        for size in JUMPS:
            rel = size.endswith("%")
            jump = case.series[at] * float(size[:-1]) / 100 if rel else sd * float(size[:-1])
            s = list(case.series)
            s[at] += jump
            p = out.setdefault((size, case.when), Power())
            p.runs += 1
            p.hit += at in fires(lambda c=case: make(c), s, at + 1)
        for climb in CLIMBS:
            rate = float(climb.split()[1][:-6]) * sd
            s = [x + rate * max(t - at + 1, 0) for t, x in enumerate(case.series)]
            hits = [t for t in fires(lambda c=case: make(c), s) if t >= at]
            p = out.setdefault((climb, case.when), Power())
            p.runs += 1
            if hits:
                p.hit += 1
                p.delay += hits[0] - at
    return out


def cost_us(make: Callable[[], object], reps: int = 2000) -> float:
    """Microseconds per check with a full window (the hot path's host cost)."""
    det = make()
    rng = random.Random(0)
    for t in range(200):
        det.check({"loss": 3.0 + rng.gauss(0, 0.01)}, t)  # type: ignore[attr-defined]
    xs = [3.0 + rng.gauss(0, 0.01) for _ in range(reps)]
    t0 = time.perf_counter()
    for t, x in enumerate(xs):
        det.check({"loss": x}, 200 + t)  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=2, help="runs per (curve, noise, level)")
    args = ap.parse_args()
    policy = SpikePolicy()
    detectors: dict[str, Callable[[], object]] = {
        "before": lambda: LegacySpikeDetector(policy),
        "now": lambda: SpikeDetector(policy),
    }
    t0 = time.perf_counter()
    fp = {name: false_positives(make, args.seeds) for name, make in detectors.items()}
    pw = {name: power(lambda _, m=make: m(), args.seeds) for name, make in detectors.items()}
    pw["oracle"] = power(Oracle, args.seeds)
    print("False positives: healthy runs with at least one spike (runs that fired / runs)\n")
    print("| curves | steps | " + " | ".join(detectors) + " |")
    print("|---|---|" + "---|" * len(detectors))
    for key in sorted(fp["now"], key=lambda k: (k[0] == "(all)", k)):
        cells = " | ".join(f"{fp[d][key][0]} / {fp[d][key][1]}" for d in detectors)
        print(f"| {key[0]} | {key[1]} | {cells} |")
    print(
        "\nDetection power: spikes caught (one-step jumps at their step; a climb within 10 steps,"
    )
    print("mean delay in steps), noise 0.005 to 0.05, white and heteroscedastic\n")
    print("| spike | when | runs | " + " | ".join(pw) + " |")
    print("|---|---|---|" + "---|" * len(pw))
    order = ["early, flat", "early, falling", "late"], [*JUMPS, *CLIMBS]
    for key in sorted(pw["now"], key=lambda k: (order[0].index(k[1]), order[1].index(k[0]))):
        p = pw["now"][key]
        cells = []
        for d in pw:
            q = pw[d][key]
            delay = f" ({q.delay / q.hit:.1f})" if key[0].startswith("climb") and q.hit else ""
            cells.append(f"{q}{delay}")
        print(f"| {key[0]} | {key[1]} | {p.runs} | " + " | ".join(cells) + " |")
    costs = ", ".join(f"{d} {cost_us(make):.0f} us" for d, make in detectors.items())
    print(f"\nCost per check, window of 100: {costs}")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
