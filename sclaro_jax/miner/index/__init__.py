"""An approximate-nearest-neighbour index for MINER galleries, re-ranked by the exact MINER score.

    python -m sclaro_jax.miner.index build --cache CACHE_DIR --out IDX       # eval.rocs's cache
    python -m sclaro_jax.miner.index build --images G.npy --crops C.npy --bank B.npy --out IDX
    python -m sclaro_jax.miner.index search --index IDX --queries Q.npy --out DIR  # hits.npz

A build calibrates the search settings it stores (`--recall`, default 0.95: the recall@10
against the exact MINER + CSLS order, measured on calibration queries; `calibration`); a search
uses them unless given flags, and says the recall they were calibrated to.

Scores (docs/design.md, section 4; `stream`'s docstring), all embeddings L2-normalised:

    S    = (1 - alpha) * t.g_i + alpha * pool_r t.c_ir               (`kernels.fuse`)
    CSLS = 2 S - r_q - r_i                                           (`kernels.csls_combine`)
    r_i  = mean of image i's k highest S over a query bank B (inductive: `stream.search(bank=)`,
           computed exactly at build time over the FUSED scores of the bank)
    r_q  = mean of query q's k highest S over its shortlist (k = min(k, shortlist size))

For one query r_q is a constant, so the order is that of 2S - r_i. Without crops that is a
maximum inner product search: 2 (t.g_i - r_i / 2) = 2 [t, 1] . [g_i, -r_i / 2]. So the global
index holds x_i = [g_i, -r_i / 2] (zero-padded to the factory's sub-quantizer multiple) and is
searched with [t, 1, 0...]. With crops the same holds per crop: since (1 - alpha) t.g_i does not
depend on r, S_i = max_r t.((1 - alpha) g_i + alpha c_ir) for max pooling (and
t.((1 - alpha) g_i + alpha mean_r c_ir) for mean), so the crop index holds the fused crop
vectors [(1 - alpha) g_i + alpha c_ir, -r_i / 2] (row i * R + r, image i; one per image for
mean pooling), and an exact inner product search over them, keeping each image's best vector,
IS the MINER + CSLS order (`crop_vectors`). The ANN approximates those inner products. A search
takes, per query, the top `shortlist_global` (default: `shortlist`) images of the global
index and the first `shortlist` distinct images of the top `shortlist * R` fused crop vectors,
their union (at most shortlist_global + shortlist images per shard), and computes the EXACT
fused score S and CSLS there from the stored float16 embeddings (a numba kernel reading them in
place on a CPU backend, jax on the GPU when there is one), with `stream.search`'s tie rule (the
lower gallery index first).
r_q over the shortlist equals stream's r_q (over the whole gallery) whenever the shortlist holds
the query's k best images by S; with a flat index and a shortlist the size of the gallery the
result is `stream.search(queries, images, crops, bank=B)` (tests/test_miner_index.py).

Build (one shard: rows [i * G // N, (i + 1) * G // N) of the gallery, `--shard i/N`), in chunks
of `chunk` images, bounded memory (one chunk of views plus the bank's [Qb, chunk] scores); the
steps (`building`):
    1. store: the chunk's views as float16 into `views.npy` [n, 1 + R, D] (global first, then
       the crops), its r_i into `parts/ri-CCCCC.npy`, the calibration queries' exact top 10
       within the chunk into `parts/cal-CCCCC.npz` (the same streamed pass);
    2. train: the FAISS indexes on a strided sample of the stored vectors (`trained-*.faiss`);
    3. add: each chunk's vectors into a copy of the trained index, `parts/{global,crops}-*.faiss`;
    4. assemble: the parts merged in order into `global.faiss` / `crops.faiss`, `r_i.npy`,
       `calibration.npz` (the calibration queries and their exact top 10), the sizes of every
       file into `meta.json`;
    5. calibrate: the cheapest search settings reaching `--recall` into meta.json's
       "calibration" (`calibration`); the parts are removed.
Fast-scan PQ (`...x4fs`, the default for large galleries) cannot be merged, so it is built as
its plain 4-bit twin (`...x4`, the same codes) and made fast-scan when it is written in step 4
(`forms.build_form`, `forms.final_index`).
The crop index's IVF lists are chosen by the crops, not by the fused vectors they store
(`route_vectors`): k-means on the crop vectors [c_ir, 0...], each fused vector added to the list
of its crop's nearest centre. A fused vector mixes the image's global view into every crop, so
lists of fused vectors group images rather than what their crops show, and a query about one
crop probes the wrong lists; the stored vectors, and so the scores, are unchanged.
`manifest.json` records each finished step and chunk (every file is written whole, then
renamed, then recorded), so a build killed at any point and run again redoes only the
unrecorded work and ends with the same files as an uninterrupted build (the trained index is
read back, not trained again). `meta.json` holds the settings (encoder, crop rule, crops, dim,
alpha, k, pool, bank hash, factory, shard, the calibration queries' hash) and, once built, the
calibrated search settings; an index, or a resumed build, with other settings is refused naming
both values (a finished index built again with another `--recall` is only calibrated again).

FAISS factories: `{nlist}` becomes 2^round(log2(sqrt(n))) for the n vectors of that index (at
most n / 39, at least 1), `{m}` becomes ceil(d / 8) (8 dimensions per sub-quantizer) and
`{m/N}` ceil(d / N); vectors are zero-padded to a multiple of the PQ size (`PQm`). The default,
"auto", is "Flat" (exact) for an index of fewer than `FLAT_BELOW` (20,000) vectors and
`LARGE_FACTORY` ("IVF{nlist},PQ{m/2}x4fs") above; it and the search defaults of an index built
before calibration were chosen by measurement (bench/README.md, "MINER ANN index on CPU"). HNSW is not supported: it has no
`merge_from` and no IVF lists.

Every number a build or a search takes has a declared range (`RANGES`: `--alpha` in [0, 1], the
counts from 1 to 2^31 - 1), checked before anything is read or written; a build refused for
any argument leaves nothing behind, and one refused while training (a factory FAISS cannot
train on so few vectors) reruns with another factory.

Ctrl-C (SIGINT) in `index build` is one line saying what is kept and that the same command
resumes (exit 130, as `data_prep import`); the rerun says what it reuses.

The package, by concern: `settings` (version, defaults, ranges, errors, factory strings),
`vectors` (what each index holds), `forms` (the FAISS indexes a build makes), `files` (the
index folder, its files, opening shards), `gallery` (what a build reads), `cache` (the gallery
embedding cache of `eval.rocs`, written and read), `building` (the build's steps),
`calibration`, `searching` and `command` (`python -m sclaro_jax.miner.index`). Their public
names are importable from here.
"""

from sclaro_jax.miner.index.building import build
from sclaro_jax.miner.index.calibration import calibrate, recalibrate
from sclaro_jax.miner.index.command import INTERRUPTED, interrupted, main
from sclaro_jax.miner.index.files import Shard, cold, kept, open_index, open_shards, prefetch
from sclaro_jax.miner.index.forms import (add_routed, build_form, final_index, new_index,
                                          routed, train_routed)
from sclaro_jax.miner.index.gallery import Gallery
from sclaro_jax.miner.index.searching import candidates, gt_ranks, search, search_settings
from sclaro_jax.miner.index.settings import (DEFAULT_FACTORY, DEFAULT_NPROBE,
                                             DEFAULT_NPROBE_GLOBAL, DEFAULT_RECALL,
                                             DEFAULT_SHORTLIST, FLAT_BELOW, LARGE_FACTORY,
                                             RANGES, SETTINGS, VERSION, FaissMissing,
                                             IndexFileError, IndexMismatchError, bank_hash,
                                             check_ranges, faiss, parse_shard, ranged,
                                             resolve_factory, shard_rows)
from sclaro_jax.miner.index.vectors import crop_vectors, global_vectors, per_image, route_vectors

__all__ = [
    "DEFAULT_FACTORY", "DEFAULT_NPROBE", "DEFAULT_NPROBE_GLOBAL", "DEFAULT_RECALL",
    "DEFAULT_SHORTLIST", "FLAT_BELOW", "INTERRUPTED", "LARGE_FACTORY", "RANGES", "SETTINGS",
    "VERSION", "FaissMissing", "Gallery", "IndexFileError", "IndexMismatchError", "Shard",
    "add_routed", "bank_hash", "build", "build_form", "calibrate", "candidates",
    "check_ranges", "cold", "crop_vectors", "faiss", "final_index", "global_vectors",
    "gt_ranks", "interrupted", "kept", "main", "new_index", "open_index", "open_shards",
    "parse_shard", "per_image", "prefetch", "ranged", "recalibrate", "resolve_factory",
    "route_vectors", "routed", "search", "search_settings", "shard_rows", "train_routed"]
