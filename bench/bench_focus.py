"""`data_prep.focus.focused_region` (vectorised numpy) against the per-pixel loop of
appendix Eqs. 4-7 that tests/test_focus.py checks it with, on a 640x480 image, one run each.

    python bench/bench_focus.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main():
    from test_focus import reference_focused_region

    from data_prep.focus import focused_region

    h, w = 480, 640
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[:h, :w]
    mask1 = (yy - 200) ** 2 + (xx - 180) ** 2 < 90 ** 2  # a disc
    mask2 = (yy > 150) & (yy < 420) & (xx > 330) & (xx < 560)  # a box
    t0 = time.perf_counter()
    ours = focused_region(image, mask1, mask2)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = reference_focused_region(image, mask1, mask2)
    t_ref = time.perf_counter() - t0
    diff = int(np.abs(ours.astype(int) - ref.astype(int)).max())
    print(f"union {float((mask1 | mask2).mean()):.0%} of pixels; max |diff| {diff} grey levels")
    print("| image | focused_region (s) | per-pixel loop (s) | speed-up |")
    print("|---|---|---|---|")
    print(f"| {w}x{h} | {t_ours:.3f} | {t_ref:.1f} | {t_ref / t_ours:.0f}x |")


if __name__ == "__main__":
    main()
