"""ClipTokenizer throughput against transformers' CLIPTokenizer (same Rust backend), same process.

    python bench/bench_tokenizer.py [--n 50000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=50_000, help="number of texts")
    args = p.parse_args(argv)

    import numpy as np
    import transformers
    from test_tokenizer import make_corpus

    from sclaro_jax.data.tokenizer import ClipTokenizer

    texts = make_corpus(args.n, seed=1)
    ours = ClipTokenizer()
    with tempfile.TemporaryDirectory() as d:
        hf = transformers.CLIPTokenizer.from_pretrained(ours.save_pretrained(d))

    def timed(fn):
        fn()
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    a, t_ours = timed(lambda: ours(texts))
    b, t_hf = timed(lambda: np.asarray(hf(texts, padding="max_length", max_length=77,
                                          truncation=True)["input_ids"]))
    assert np.array_equal(a, b)
    print("| texts | ClipTokenizer (s) | transformers CLIPTokenizer (s) | texts/s (ours) |")
    print("|---|---|---|---|")
    print(f"| {args.n} | {t_ours:.3f} | {t_hf:.3f} | {args.n / t_ours:,.0f} |")


if __name__ == "__main__":
    main()
