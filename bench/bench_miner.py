"""MINER kernels on CPU against the numpy way MINER's reference code scores
(docs/design.md, section 4).

(1) CSLS on a Q x G float32 score matrix (default 8,231 x 32,768): jitted `csls` vs `np.partition`
top-k means on both axes, then 2S - r_q - r_i. (2) Fused + CSLS scoring of the ROCS-COCO shape
(8,231 queries, 3,248 images, 5 crops, dim 1152, random L2-normalised embeddings): `fused_scores`
+ `csls` vs numpy fusion in 128-image chunks, then the same numpy CSLS. Each round times both
once, alternating the order; figures are medians over rounds after one compile call. Optionally
(--sweep-blocks) the top-k block lengths on the CSLS matrix, and (--host-input) `csls` given
the matrix as a numpy array (as numpy allocates it, and 64-byte aligned) against a device array.
(3) With --authors-lib, the MINER authors' own C++ CSLS (built by you from their repository,
AbdulmalikDS/ROCS, appendix/optimization/csls.cpp; it stays outside this one) against ours on
numpy and on resident input, with a plain copy as the memory bound; --authors-gpu does the same
with their torch version on a GPU (--authors-cu: their CUDA kernels, csls.cu), --authors-score makes their retrieval.py's numpy `score` the
reference of (2).

    python bench/bench_miner.py                      # full size (memory: see bench/README.md)
    g++ -O3 -march=native -fopenmp -shared -fPIC csls.cpp -o /tmp/libcsls.so   # in their repo
    python bench/bench_miner.py --skip-csls --skip-rocs --authors-lib /tmp/libcsls.so
    python bench/bench_miner.py --queries 800 --images 3000 --rocs-queries 500 --rocs-images 300
    python bench/bench_miner.py --skip-csls --skip-rocs --host-input --images 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_gib() -> float:
    """VmHWM of this process (peak resident set), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2 ** 20
    return float("nan")


def numpy_topk_mean(s: np.ndarray, k: int, axis: int) -> np.ndarray:
    return np.partition(s, -k, axis=axis).take(np.arange(-k, 0), axis=axis).mean(axis=axis)


def numpy_csls(s: np.ndarray, k: int) -> np.ndarray:
    r_q = numpy_topk_mean(s, k, 1)
    r_i = numpy_topk_mean(s, k, 0)
    return 2 * s - r_q[:, None] - r_i[None, :]


def numpy_fused(text: np.ndarray, gallery: np.ndarray, crops: np.ndarray, alpha: float,
                chunk: int = 128) -> np.ndarray:
    q, (g, r, d) = text.shape[0], crops.shape
    out = np.empty((q, g), np.float32)
    for i in range(0, g, chunk):
        c = crops[i:i + chunk]
        crop_best = (text @ c.reshape(-1, d).T).reshape(q, len(c), r).max(-1)
        out[:, i:i + chunk] = (1 - alpha) * (text @ gallery[i:i + chunk].T) + alpha * crop_best
    return out


def rounds(ref: Callable[[], np.ndarray], ours: Callable[..., object], repeats: int,
           prepare: Callable[[], object] | None = None
           ) -> tuple[float, float, np.ndarray, np.ndarray]:
    """Median seconds of `ref` and `ours` over `repeats` alternating rounds (ours compiled
    first), and the last outputs of each. With `prepare`, `ours(prepare())` is timed and
    `prepare()` (e.g. a fresh device copy to donate) is not."""
    if prepare is not None:
        timed = ours
        ours = None
    out_ours = timed(prepare()) if prepare is not None else ours()
    np.asarray(out_ours)
    times = np.zeros((repeats, 2))
    out_ref = None
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            if i == 0:
                out_ref = ref()
            else:
                if prepare is not None:
                    arg = prepare()
                    arg.block_until_ready()
                    t0 = time.perf_counter()
                    out_ours = timed(arg)
                else:
                    out_ours = ours()
                out_ours.block_until_ready()
            times[r, i] = time.perf_counter() - t0
    med = np.median(times, axis=0)
    return float(med[0]), float(med[1]), out_ref, np.asarray(out_ours)


def normalised(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def aligned_copy(s: np.ndarray, alignment: int = 64) -> np.ndarray:
    """`s` copied into a buffer whose data starts on an `alignment`-byte boundary (numpy's own
    large allocations are 16-byte aligned)."""
    buf = np.empty(s.nbytes + alignment, np.uint8)
    start = (-buf.ctypes.data) % alignment
    out = buf[start:start + s.nbytes].view(s.dtype).reshape(s.shape)
    out[...] = s
    return out


def host_input(s: np.ndarray, k: int, repeats: int) -> None:
    """`csls` on the same matrix given as a numpy array (numpy's allocation, and a 64-byte
    aligned copy) and as a device array: median seconds over alternating rounds."""
    import jax

    from sclaro_jax.miner import csls

    inputs = {"numpy array": s, "numpy array, 64-byte aligned": aligned_copy(s),
              "jax array": jax.device_put(s)}
    for x in inputs.values():
        csls(x, k=k).block_until_ready()
    times = {name: [] for name in inputs}
    for r in range(repeats):
        for name in (list(inputs) if r % 2 == 0 else list(inputs)[::-1]):
            t0 = time.perf_counter()
            csls(inputs[name], k=k).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    print(f"\n| CSLS k={k}, {s.shape[0]} x {s.shape[1]}, input | median (s) | rounds (s) |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {np.median(ts):.3f} | {', '.join(f'{t:.2f}' for t in ts)} |",
              flush=True)


def load_authors_lib(path: str):
    """The MINER authors' C++ CSLS (repository AbdulmalikDS/ROCS, appendix/optimization/csls.cpp),
    built by the user outside this repository, e.g.
    `g++ -O3 -march=native -fopenmp -shared -fPIC csls.cpp -o libcsls.so`. It works in place:
    `csls(float* sim, int rows, int cols, int k)`."""
    import ctypes

    if not Path(path).is_file():
        raise SystemExit(f"--authors-lib {path}: no such file (build the authors' csls.cpp "
                         "with g++ -O3 -march=native -fopenmp -shared -fPIC)")
    lib = ctypes.CDLL(str(Path(path).resolve()))
    lib.csls.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.csls.restype = None
    return lib


def load_python_file(path: str, name: str, what: str):
    """Function `name` of the Python file at `path` (e.g. the authors' retrieval.py)."""
    import importlib.util

    if not Path(path).is_file():
        raise SystemExit(f"{what} {path}: no such file")
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_authors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{what} {path}: no function {name!r} in it")
    return getattr(module, name)


def timed_rounds(contenders: dict[str, tuple[Callable[[], object], Callable[[object], object]]],
                 repeats: int, skip_after_first: tuple[str, ...] = ()
                 ) -> dict[str, list[float]]:
    """Seconds of each contender over `repeats` rounds, the order reversed every other round.
    A contender is (prepare, run): `prepare()` (untimed: a fresh copy to work in place on) makes
    the argument of `run`, whose result is waited for. Names in `skip_after_first` run in the
    first round only (the slow numpy reference)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            if r > 0 and name in skip_after_first:
                continue
            prepare, run = contenders[name]
            arg = prepare()
            if hasattr(arg, "block_until_ready"):
                arg.block_until_ready()
            t0 = time.perf_counter()
            out = run(arg)
            if hasattr(out, "block_until_ready"):
                out.block_until_ready()
            times[name].append(time.perf_counter() - t0)
            del out, arg
    return times


def csls_matrix(rng: np.random.Generator, queries: int, images: int) -> np.ndarray:
    """The scores the CSLS measurements time: float32 Gaussian with std 0.1."""
    s = rng.standard_normal((queries, images), dtype=np.float32)
    s *= np.float32(0.1)
    return s


def authors_table(queries: int, sizes: list[int], k: int, repeats: int, lib_path: str,
                  numpy_rounds: int) -> None:
    """CSLS side by side: the authors' numpy form, their C++ (in place on a fresh copy made
    outside the timer), ours on numpy input (numpy out), ours on a device-resident matrix
    (donated: the output is written over it; and not donated: a fresh output), and a plain copy
    of the matrix into an existing buffer (one read and one write of it: the memory bound's
    measure; CSLS needs at least two reads and one write, 1.5 copies)."""
    import jax

    from sclaro_jax.miner import csls

    lib = load_authors_lib(lib_path)
    rng = np.random.default_rng(0)
    print(f"\n| CSLS k={k}, queries x gallery | their numpy (s) | their C++ (s) "
          "| ours, numpy in (s) | ours / C++ | ours, resident, donated (s) | ours / C++ "
          "| ours, resident (s) | plain copy (s) | bound: 1.5 copies (s) | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for images in sizes:
        s = csls_matrix(rng, queries, images)
        device = jax.device_put(s) + 0  # an XLA-owned buffer, as a computed matrix is
        sink = np.empty_like(s)
        sink[...] = 1  # pages touched: the copy below measures memory, not page faults

        def their_cpp(x):
            lib.csls(x.ctypes.data, x.shape[0], x.shape[1], k)
            return x

        contenders = {
            "numpy": (lambda: None, lambda _: numpy_csls(s, k)),
            "cpp": (lambda: s.copy(), their_cpp),
            "ours_numpy": (lambda: None, lambda _: csls(s, k=k)),
            "ours_donated": (lambda: device + 0, lambda x: csls(x, k=k, donate=True)),
            "ours_resident": (lambda: None, lambda _: csls(device, k=k)),
            "copy": (lambda: None, lambda _: np.copyto(sink, s)),
        }
        # warm-up (compilations, numba's cache) and agreement
        ref = their_cpp(s.copy())
        diff = max(float(np.abs(np.asarray(csls(s, k=k)) - ref).max()),
                   float(np.abs(np.asarray(csls(device + 0, k=k, donate=True)) - ref).max()),
                   float(np.abs(np.asarray(csls(device, k=k)) - ref).max()))
        del ref
        times = timed_rounds(contenders, repeats,
                             skip_after_first=("numpy",) if numpy_rounds <= 1 else ())
        med = {name: float(np.median(ts)) for name, ts in times.items()}
        print(f"| {queries:,} x {images:,} | {med['numpy']:.2f} | {med['cpp']:.3f} "
              f"| {med['ours_numpy']:.3f} | {med['ours_numpy'] / med['cpp']:.2f}x "
              f"| {med['ours_donated']:.3f} | {med['ours_donated'] / med['cpp']:.2f}x "
              f"| {med['ours_resident']:.3f} | {med['copy']:.3f} | {1.5 * med['copy']:.3f} "
              f"| {diff:.1e} |", flush=True)
        print("  rounds (s): " + "; ".join(f"{name} " + ", ".join(f"{t:.3f}" for t in ts)
                                           for name, ts in times.items()), flush=True)
        del device, sink, s


def load_authors_cu(path: str):
    """The MINER authors' CUDA CSLS (appendix/optimization/csls.cu, a path the user gives),
    built here with nvcc for this GPU, as `fn(torch_cuda_matrix, k)` (in place)."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    if not Path(path).is_file():
        raise SystemExit(f"--authors-cu {path}: no such file")
    if shutil.which("nvcc") is None:
        raise SystemExit("--authors-cu needs nvcc to build their csls.cu")
    lib = str(Path(tempfile.mkdtemp()) / "libcsls_cuda.so")
    subprocess.run(["nvcc", "-O3", "-arch=native", "-shared", "-Xcompiler", "-fPIC", "-o", lib,
                    path], check=True)
    fn = ctypes.CDLL(lib).csls_cuda
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = None

    def run(matrix, k):
        fn(ctypes.c_void_p(matrix.data_ptr()), matrix.shape[0], matrix.shape[1], k)
        return matrix

    return run


def resident_table(queries: int, sizes: list[int], k: int, repeats: int, path: str | None,
                   cu_path: str | None = None) -> list[dict]:
    """CSLS on a matrix resident on this process's device: ours (donated) against a plain device
    copy (the bandwidth measure) and, on a CUDA GPU, against the MINER authors' torch `csls_gpu`
    (appendix/optimization/csls_gpu.py) and CUDA kernels (csls.cu), paths the user gives, each
    on a resident torch matrix and checked against ours first. Returns the rows (milliseconds,
    medians) after printing them."""
    import jax

    from sclaro_jax.miner import csls

    theirs = {}  # name -> fn(torch matrix, k)
    if path or cu_path:
        try:
            import torch
        except ImportError:
            raise SystemExit("--authors-gpu / --authors-cu need torch with CUDA (to hold their "
                             "matrix)") from None
        if not torch.cuda.is_available() or jax.default_backend() != "gpu":
            raise SystemExit("--authors-gpu / --authors-cu need a CUDA GPU visible to both "
                             "torch and jax")
        if path:
            torch_csls = load_python_file(path, "csls_gpu", "--authors-gpu")
            theirs["torch"] = lambda m, k: torch_csls(m, k=k)
        if cu_path:
            theirs["cuda"] = load_authors_cu(cu_path)
    rng = np.random.default_rng(0)
    print(f"\n| CSLS k={k} on {jax.default_backend()}, queries x gallery | theirs (ms) "
          "| ours, resident, donated (ms) | ours / theirs | device copy (ms) "
          "| ours: bytes moved per second (2 reads + 1 write) | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for images in sizes:
        s = csls_matrix(rng, queries, images)
        j_mat = jax.device_put(s)
        want = np.asarray(csls(j_mat + 0, k=k, donate=True))
        contenders = {"ours": (lambda: j_mat + 0, lambda x: csls(x, k=k, donate=True)),
                      "copy": (lambda: None, lambda _: j_mat + 0)}
        diffs = {}
        if theirs:
            t_mat = torch.from_numpy(s).cuda()

            def synchronised(fn):
                def run(matrix):
                    out = fn(matrix, k)
                    torch.cuda.synchronize()
                    return out
                return run

            # theirs work on a fresh copy each time (csls.cu overwrites its input)
            for name, fn in theirs.items():
                contenders[name] = (t_mat.clone, synchronised(fn))
                diffs[name] = float(np.abs(fn(t_mat.clone(), k).cpu().numpy() - want).max())
        times = timed_rounds(contenders, max(repeats, 5))
        med = {name: float(np.median(ts)) * 1e3 for name, ts in times.items()}
        gbytes = s.nbytes / 1e9
        base = {"backend": jax.default_backend(), "queries": queries, "images": images,
                "ours_ms": med["ours"], "copy_ms": med["copy"],
                "ours_gb_s": 3 * gbytes / med["ours"] * 1e3,
                "copy_gb_s": 2 * gbytes / med["copy"] * 1e3}
        for name in list(theirs) or [None]:
            row = dict(base, theirs=name, theirs_ms=med.get(name), max_abs_diff=diffs.get(name))
            rows.append(row)
            their = f"{name} {med[name]:.2f}" if name else "-"
            ratio = f"{med['ours'] / med[name]:.2f}x" if name else "-"
            print(f"| {queries:,} x {images:,} | {their} | {med['ours']:.2f} | {ratio} "
                  f"| {med['copy']:.2f} | {row['ours_gb_s']:.0f} GB/s (copy: "
                  f"{row['copy_gb_s']:.0f} GB/s) | "
                  f"{'-' if name is None else format(diffs[name], '.1e')} |", flush=True)
        del j_mat, s
    return rows


def sweep_blocks(s, k: int, repeats: int) -> None:
    import jax

    from sclaro_jax import compile
    from sclaro_jax.miner.kernels import _topk_first_values, _topk_last

    def best(fn) -> float:
        fn(s).block_until_ready()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(s).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    # Each axis compiled the way sclaro_jax.miner.kernels compiles it: rows with XLA's default
    # options, columns with sclaro_jax.compile's.
    print("\n| block | top-k mean, last axis, jax.jit (s) "
          "| top-k mean, first axis, compile.jit (s) |")
    print("|---|---|---|")
    last = best(jax.jit(lambda x: jax.lax.top_k(x, k)[0].mean(-1)))
    first = best(compile.jit(lambda x: jax.lax.top_k(x.T, k)[0].mean(-1)))
    print(f"| lax.top_k | {last:.3f} | {first:.3f} |", flush=True)
    for block in (16, 32, 64, 128, 256):
        last = best(jax.jit(lambda x: _topk_last(x, k, block)[0].mean(-1)))
        first = best(compile.jit(lambda x: _topk_first_values(x, k, block).mean(-1)))
        print(f"| {block} | {last:.3f} | {first:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=8231, help="CSLS matrix rows")
    parser.add_argument("--images", type=int, default=32768, help="CSLS matrix columns")
    parser.add_argument("--rocs-queries", type=int, default=8231)
    parser.add_argument("--rocs-images", type=int, default=3248)
    parser.add_argument("--crops", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1152)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement")
    parser.add_argument("--sweep-blocks", action="store_true",
                        help="also time the blocked top-k for several block lengths")
    parser.add_argument("--host-input", action="store_true",
                        help="also time csls on a numpy matrix (as is and 64-byte aligned) "
                             "against the same matrix on the device")
    parser.add_argument("--authors-lib", metavar="PATH",
                        help="a build of the MINER authors' C++ CSLS (their csls.cpp, built "
                             "outside this repository): time numpy, theirs, ours on numpy input "
                             "and ours on resident input side by side, with a plain copy as the "
                             "memory bound, at --queries x each of --authors-images")
    parser.add_argument("--authors-images", type=int, nargs="+", default=[8192, 32768],
                        help="gallery sizes of the --authors-lib / --authors-gpu tables")
    parser.add_argument("--numpy-rounds", type=int, default=1,
                        help="rounds of the (slow) numpy form in the --authors-lib table: 1 "
                             "times it once, more times it every round")
    parser.add_argument("--authors-gpu", metavar="PATH",
                        help="the authors' csls_gpu.py (torch): time it against ours on a GPU")
    parser.add_argument("--authors-cu", metavar="PATH",
                        help="the authors' csls.cu: built with nvcc, timed as --authors-gpu")
    parser.add_argument("--resident", action="store_true",
                        help="CSLS on a matrix on this process's device against a device copy "
                             "(with --authors-gpu / --authors-cu: against theirs too), at "
                             "--queries x each of --authors-images")
    parser.add_argument("--json", metavar="FILE",
                        help="write the --resident rows to FILE")
    parser.add_argument("--authors-score", metavar="PATH",
                        help="the authors' retrieval.py: its numpy `score` is the reference of "
                             "the fused + CSLS measurement (else our transcription of it)")
    parser.add_argument("--skip-csls", action="store_true")
    parser.add_argument("--skip-rocs", action="store_true")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from sclaro_jax.miner import csls, fused_scores

    rng = np.random.default_rng(0)
    print("| measurement | shape | numpy median (s) | ours median (s) | speed-up "
          "| max abs diff | peak RSS (GiB) |")
    print("|---|---|---|---|---|---|---|")
    s = None
    if not args.skip_csls:
        s = csls_matrix(rng, args.queries, args.images)
        s_dev = jax.device_put(s)
        ref_t, ours_t, ref, ours = rounds(lambda: numpy_csls(s, args.k),
                                          lambda: csls(s_dev, k=args.k), args.repeats)
        diff = float(np.abs(ref - ours).max())
        del ref, ours
        print(f"| CSLS k={args.k} | {args.queries} x {args.images} | {ref_t:.2f} | {ours_t:.3f} "
              f"| {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |", flush=True)
        # The same with the score buffer donated to the output (`csls(..., donate=True)`): the
        # input is a fresh device copy made outside the timing, as a caller's intermediate is.
        ref_t, ours_t, ref, ours = rounds(lambda: numpy_csls(s, args.k),
                                          lambda x: csls(x, k=args.k, donate=True),
                                          args.repeats, prepare=lambda: s_dev + 0)
        diff = float(np.abs(ref - ours).max())
        del ref, ours
        print(f"| CSLS k={args.k}, donate=True | {args.queries} x {args.images} | {ref_t:.2f} "
              f"| {ours_t:.3f} | {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |",
              flush=True)
    if not args.skip_rocs:
        text = normalised(rng, args.rocs_queries, args.dim)
        gallery = normalised(rng, args.rocs_images, args.dim)
        crops = normalised(rng, args.rocs_images, args.crops, args.dim)
        dev = [jax.device_put(a) for a in (text, gallery, crops)]

        def ours():
            # the fused matrix is an intermediate: its buffer becomes the output
            return csls(fused_scores(*dev, alpha=args.alpha), k=args.k, donate=True)

        if args.authors_score:
            score = load_python_file(args.authors_score, "score", "--authors-score")
            reference = lambda: score(text, gallery, crops, alpha=args.alpha, k=args.k)  # noqa: E731
        else:
            reference = lambda: numpy_csls(numpy_fused(text, gallery, crops, args.alpha),  # noqa: E731
                                           args.k)
        ref_t, ours_t, ref, out = rounds(reference, ours, args.repeats)
        diff = float(np.abs(ref - out).max())
        del ref, out
        print(f"| fused (max of {args.crops} crops) + CSLS k={args.k} | {args.rocs_queries} x "
              f"{args.rocs_images}, dim {args.dim} | {ref_t:.2f} | {ours_t:.3f} "
              f"| {ref_t / ours_t:.1f}x | {diff:.1e} | {peak_rss_gib():.2f} |", flush=True)
    if args.authors_lib:
        authors_table(args.queries, args.authors_images, args.k, args.repeats, args.authors_lib,
                      args.numpy_rounds)
    if args.resident or args.authors_gpu or args.authors_cu:
        rows = resident_table(args.queries, args.authors_images, args.k, args.repeats,
                              args.authors_gpu, args.authors_cu)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.host_input:
        if s is None:
            s = csls_matrix(rng, args.queries, args.images)
        host_input(s, args.k, args.repeats)
    if args.sweep_blocks:
        if s is None:
            s = rng.standard_normal((args.queries, args.images), dtype=np.float32)
        sweep_blocks(jax.device_put(s), args.k, args.repeats)


if __name__ == "__main__":
    main()
