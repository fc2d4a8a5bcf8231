"""How far one hostile client of four moves the global state, in honest-only steps, per robust setting.

    .venv/bin/python bench/robust_bound.py            # ~10 s: the table in docs/robustness.md
    .venv/bin/python bench/robust_bound.py --trials 5 # quicker, noisier

Three honest clients send ``common + noise·N(0, I)`` (their counts 800..1200), the hostile one
a sign-flipped (``-1000 ×`` the honest mean) or an orthogonal (norm 1000× larger) update with
10¹⁸ examples. Both rounds go through ``strategies.robust``'s count cap and norm clip and the
example-weighted mean, as ``PayloadFedAvg`` does with ``aggregator: mean``. Printed: the worst
``‖with hostile − honest only‖ / ‖honest only‖`` over the trials, per (examples_multiple,
norm_multiple), attack and noise level (noise 0.5 → honest updates nearly aligned, 3 → nearly
orthogonal). Below 1: the hostile client moves the state less than the honest clients do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strategies.robust import Robustness, cap_weights, clip_scales  # noqa: E402

SETTINGS = [(100.0, 10.0), (2.0, 2.0), (1.0, 2.0), (2.0, 1.0), (1.0, 1.5)]
NOISE = (0.5, 1.0, 2.0, 3.0)


def combine(updates, weights, settings: Robustness) -> np.ndarray:
    capped = cap_weights(weights, settings)
    scales = clip_scales([float(np.linalg.norm(u)) for u in updates], settings)
    return np.average([u * f for u, f in zip(updates, scales)], axis=0, weights=capped)


def worst(settings: Robustness, attack: str, noise: float, trials: int, dim: int, rng) -> float:
    out = 0.0
    for _ in range(trials):
        common = rng.normal(size=dim)
        honest = [common + noise * rng.normal(size=dim) for _ in range(3)]
        counts = [int(c) for c in rng.integers(800, 1200, 3)]
        step = combine(honest, counts, settings)
        if attack == "sign-flip":
            hostile = -1e3 * step
        else:
            r = rng.normal(size=dim)
            hostile = 1e3 * (r - r @ step / (step @ step) * step)
        moved = combine(honest + [hostile], counts + [10**18], settings)
        out = max(out, float(np.linalg.norm(moved - step) / np.linalg.norm(step)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--dim", type=int, default=1000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| examples_multiple / norm_multiple | attack | " + " | ".join(f"noise {n}" for n in NOISE) + " | worst |")
    print("|---|---|" + "---:|" * (len(NOISE) + 1))
    for c, k in SETTINGS:
        settings = Robustness(examples_multiple=c, norm_multiple=k)
        for attack in ("sign-flip", "orthogonal"):
            row = [worst(settings, attack, n, args.trials, args.dim, rng) for n in NOISE]
            print(f"| {c:g} / {k:g} | {attack} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {max(row):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
