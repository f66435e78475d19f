"""The packed crop layout: every crop of a batch, and no padding beyond a planned budget.

The reference code flattens the object crops (relation regions) of a batch into one tensor per
level. The packed layout does the same with static shapes: per crop level, one buffer of K
slots holds the crops of all images of the batch, image after image in batch order and each
image's crops in record order, then padding. Fields per level (names in
`sclaro_jax.data.batch.LEVEL_FIELDS`): pixels [K, S, S, 3], tokens [K, L], labels [K] (-1 for
padding), mask [K] (real crop) and segments [K] int32 (the image index 0..B-1 of the crop;
`PAD_SEGMENT` for padding).

K is not fixed: a batch takes the smallest of a few sizes (tiers) that holds its crops, so each
size compiles once and a batch with many crops never drops any. `plan` picks the sizes from the
split's count histograms (`split_histograms`: the manifest's `count_histograms`, or one pass
over the records): the batch total of a level is the sum of B draws from its histogram, and the
smaller tiers minimise the expected number of slots (real crops + padding) under that law; the
largest is B x the split's largest per-image count, so nothing can be dropped. A tier holds both
levels' sizes: at most `MAX_TIERS` compiled step shapes in all.

`unpack` turns a packed batch into the per-image caps view [B, N] (notebooks, evaluators);
`pack` does the reverse (tests, benchmarks); `grow` pads a packed batch to a larger tier (hosts
of a multi-process run agree on one tier per step).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from sclaro_jax.data import batch as fields

log = logging.getLogger(__name__)

LAYOUTS = ("caps", "packed")
PAD_SEGMENT = -1
MAX_TIERS = 3
HISTOGRAMS = "count_histograms"  # manifest key: split -> {"objects": [...], "relations": [...]}


@dataclasses.dataclass(frozen=True)
class PackedSizes:
    """The crop slots of each tier for a batch of `batch_size` images: `objects[t]`,
    `relations[t]` (non-decreasing in t), and the split's largest per-image counts
    (`max_objects`, `max_relations`: a record with more loses the rest, counted as dropped).
    The last tier holds `batch_size` x the largest counts."""
    batch_size: int
    objects: tuple[int, ...]
    relations: tuple[int, ...]
    max_objects: int
    max_relations: int

    def __post_init__(self):
        object.__setattr__(self, "objects", tuple(int(k) for k in self.objects))
        object.__setattr__(self, "relations", tuple(int(k) for k in self.relations))
        n = len(self.objects)
        if not 1 <= n <= MAX_TIERS or len(self.relations) != n:
            raise ValueError(f"PackedSizes: 1 to {MAX_TIERS} tiers, as many for objects "
                             f"{self.objects} as for relations {self.relations}")
        for name, sizes, cap in (("objects", self.objects, self.max_objects),
                                 ("relations", self.relations, self.max_relations)):
            if min(sizes) < 1 or list(sizes) != sorted(sizes):
                raise ValueError(f"PackedSizes.{name} {sizes}: positive and non-decreasing")
            if sizes[-1] < self.batch_size * cap:
                raise ValueError(f"PackedSizes.{name}: the last tier ({sizes[-1]}) must hold "
                                 f"batch_size x max_{name} = {self.batch_size * cap}")

    @property
    def tiers(self) -> int:
        return len(self.objects)

    def slots(self, level: str, tier: int) -> int:
        """Crop slots of `level` ("object" / "relation") at `tier`."""
        return (self.objects if level == "object" else self.relations)[tier]

    def caps(self) -> dict[str, int]:
        """Crop level -> the largest count taken from one image."""
        return {"object": self.max_objects, "relation": self.max_relations}

    def tier(self, n_objects: int, n_relations: int) -> int:
        """The smallest tier that holds `n_objects` and `n_relations` crops."""
        for t in range(self.tiers):
            if n_objects <= self.objects[t] and n_relations <= self.relations[t]:
                return t
        raise ValueError(f"{n_objects} objects and {n_relations} relations exceed the largest "
                         f"packed size ({self.objects[-1]}, {self.relations[-1]})")

    def tier_of(self, batch: dict) -> int:
        """The tier of a packed batch, from its shapes."""
        shape = tuple(batch[fields.LEVEL_FIELDS[level].mask].shape[0] for level in fields.CROP_LEVELS)
        for t in range(self.tiers):
            if shape == (self.objects[t], self.relations[t]):
                return t
        raise ValueError(f"a packed batch with {shape} (object, relation) slots is none of the "
                         f"planned sizes {list(zip(self.objects, self.relations))}")

    def describe(self) -> str:
        return ", ".join(f"{o} object + {r} relation slots"
                         for o, r in zip(self.objects, self.relations))


# ---------------------------------------------------------------- count statistics and planning

def histogram(counts) -> list[int]:
    """Per-image counts -> [number of images with 0, with 1, ...] (a manifest's histogram)."""
    counts = np.asarray(counts, np.int64)
    return np.bincount(counts, minlength=1).tolist() if counts.size else [0]


def split_histograms(dataset, split: str, progress: bool = True) -> tuple[list[int], list[int]]:
    """(objects, relations) count histograms of `split`: the manifest's `count_histograms`
    (written by `data_prep` since the packed layout), else one pass over the split's records
    (a progress bar; `python -m data_prep reshard` writes them into a dataset once)."""
    entry = dataset.manifest["splits"][split]
    stored = entry.get(HISTOGRAMS)
    if stored:
        return list(stored["objects"]), list(stored["relations"])
    from tqdm.auto import tqdm

    log.info("%s has no count histograms in its manifest (written before the packed layout): "
             "reading the %d records of %r once to plan the packed sizes", dataset.root,
             entry["records"], split)
    objects, relations = [], []
    with tqdm(total=entry["records"], desc=f"counting crops ({split})", unit="record",
              disable=not progress) as bar:
        # a record that does not decode is passed over: the pipeline turns it into an example
        # without crops
        for sample in dataset.samples(split, skip_bad=True):
            objects.append(len(sample.objects))
            relations.append(len(sample.relations))
            bar.update(1)
    return histogram(objects), histogram(relations)


def sum_distribution(hist, batch_size: int) -> np.ndarray:
    """P(the batch total = k), k = 0..batch_size * max: the `batch_size`-fold convolution of the
    per-image count law `hist` (images drawn independently), by FFT."""
    p = np.asarray(hist, np.float64)
    if p.sum() <= 0:
        p = np.array([1.0])
    p = p / p.sum()
    support = (len(p) - 1) * batch_size + 1
    n = 1 << int(np.ceil(np.log2(max(support, 2))))
    out = np.fft.irfft(np.fft.rfft(p, n) ** batch_size, n)[:support]
    out = np.clip(out, 0.0, None)
    return out / out.sum()


def _aligned(k, align: int) -> int:
    return max(align, int(-(-int(k) // align) * align))


def plan(hist_objects, hist_relations, batch_size: int, *, align: int = 1,
         max_sizes: int = MAX_TIERS, grid: int = 60) -> PackedSizes:
    """The packed sizes for batches of `batch_size` images whose per-image counts follow the
    histograms: at most `max_sizes` tiers (each compiles once), the last B x the largest
    counts. Sizes are multiples of `align` (the devices a host's slice is split over).

    A smaller tier t holds each level's (1 - p_t) quantile of the batch total, one p_t for both
    levels; the p_t minimise the expected slots per batch (each batch at the smallest tier that
    holds it) over a log grid of p in [1e-7, 0.5]. On long-tailed counts the smallest tier then
    takes about three batches in four: one that overflowed rarely would pad much more
    (bench/README.md, "Static-shape layouts"). `max_sizes=1`: one size, B x the largest counts
    (a short run that would spend more time compiling sizes than they save)."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if not 1 <= max_sizes <= MAX_TIERS:
        raise ValueError(f"max_sizes must be 1 to {MAX_TIERS}, got {max_sizes}")
    hists = [np.asarray(h, np.float64) for h in (hist_objects, hist_relations)]
    caps = [int(np.nonzero(h)[0].max()) if h.any() else 0 for h in hists]
    cdfs = [np.cumsum(sum_distribution(h, batch_size)) for h in hists]
    top = tuple(_aligned(batch_size * c, align) for c in caps)

    def size(p):
        return tuple(min(_aligned(np.searchsorted(c, 1 - p - 1e-12), align), t)
                     for c, t in zip(cdfs, top))

    def fits(sz):
        return float(np.prod([c[min(k, len(c) - 1)] for c, k in zip(cdfs, sz)]))

    def cost(tiers):  # expected slots: each batch at the smallest tier that holds it
        held = [fits(t) for t in tiers] + [1.0]
        return sum((held[i] - (held[i - 1] if i else 0.0)) * sum(t)
                   for i, t in enumerate([*tiers, top]))

    ps = np.logspace(-7, np.log10(0.5), grid)
    candidates = [[]]
    if max_sizes >= 2:
        candidates += [[size(p)] for p in ps]
    if max_sizes == 3:  # p_1 < p_0: the tiers grow in both levels
        candidates += [[size(p0), size(p1)] for i, p0 in enumerate(ps) for p1 in ps[:i]]
    best = min(candidates, key=cost)
    tiers = sorted(set([*best, top]))  # equal tiers (small data, tiny batches) merge
    return PackedSizes(batch_size, tuple(t[0] for t in tiers), tuple(t[1] for t in tiers),
                       caps[0], caps[1])


def expected_use(sizes: PackedSizes, hist_objects, hist_relations) -> dict:
    """Under the planning law: the share of batches at each tier, the expected slots per batch
    and the expected padding (the fraction of slots that hold no crop), per level and in all."""
    b = sizes.batch_size
    hists = [np.asarray(h, np.float64) for h in (hist_objects, hist_relations)]
    cdfs = [np.cumsum(sum_distribution(h, b)) for h in hists]
    fit = [float(np.prod([c[min(k, len(c) - 1)] for c, k in zip(cdfs, t)]))
           for t in zip(sizes.objects, sizes.relations)]
    share = np.diff([0.0] + fit)
    share[-1] += 1.0 - sum(share)
    slots = {"object": float(np.dot(share, sizes.objects)),
             "relation": float(np.dot(share, sizes.relations))}
    crops = {level: b * float(np.dot(np.arange(len(h)), h) / max(h.sum(), 1))
             for level, h in zip(fields.CROP_LEVELS, hists)}
    return {"tier_share": share.tolist(), "slots": slots, "crops": crops,
            "padding": {level: 1 - crops[level] / slots[level] for level in slots},
            "padding_all": 1 - sum(crops.values()) / sum(slots.values())}


# ---------------------------------------------------------------- layout conversions (numpy)

def is_packed(batch: dict) -> bool:
    """Whether `batch` has the packed layout (its crop levels carry segment ids)."""
    return fields.LEVEL_FIELDS["object"].segments in batch


def counts(batch: dict, level: str) -> np.ndarray:
    """Crops per image [B] of a packed batch's `level`."""
    f = fields.LEVEL_FIELDS[level]
    seg = np.asarray(batch[f.segments])[np.asarray(batch[f.mask], bool)]
    return np.bincount(seg, minlength=len(batch[fields.VALID])).astype(np.int32)


def unpack(batch: dict, caps: dict[str, int] | None = None) -> dict:
    """A packed batch in the caps layout: per crop level pixels [B, N, ...], tokens [B, N, L],
    labels [B, N] (-1 padding) and mask [B, N], N = `caps[level]` (default: the batch's largest
    count of that level); per-image fields as they are. Crops past a given cap are left out
    and added to the image's `dropped_*` count. numpy, on the host."""
    if not is_packed(batch):
        return batch
    out = {k: v for k, v in batch.items()
           if k not in {f.segments for f in fields.LEVEL_FIELDS.values() if f.segments}}
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        mask = np.asarray(batch[f.mask], bool)
        seg = np.asarray(batch[f.segments])[mask]
        n_img = counts(batch, level)
        cap = int(n_img.max(initial=0)) if caps is None else int(caps[level])
        starts = np.concatenate([[0], np.cumsum(n_img)[:-1]])
        rank = np.arange(len(seg)) - starts[seg]  # crops of an image are contiguous, in order
        keep = rank < cap
        rows, cols = seg[keep], rank[keep]
        b = len(n_img)
        for name, fill in ((f.pixels, 0), (f.tokens, 0), (f.labels, -1)):
            src = np.asarray(batch[name])[mask][keep]
            dst = np.full((b, cap, *src.shape[1:]), fill, src.dtype)
            dst[rows, cols] = src
            out[name] = dst
        out[f.mask] = np.zeros((b, cap), bool)
        out[f.mask][rows, cols] = True
        out[f.dropped] = (np.asarray(batch[f.dropped]) + np.maximum(n_img - cap, 0)
                          ).astype(np.int32)
    return out


def pack(batch: dict, slots: dict[str, int] | None = None) -> dict:
    """A caps batch in the packed layout with `slots[level]` slots per crop level (default: the
    batch's own crop count, at least 1); the valid crops of valid images in order. numpy."""
    if is_packed(batch):
        return batch
    out = dict(batch)
    valid = np.asarray(batch[fields.VALID], bool)
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        mask = np.asarray(batch[f.mask], bool) & valid[:, None]
        rows, _ = np.nonzero(mask)
        k = max(len(rows), 1) if slots is None else int(slots[level])
        if len(rows) > k:
            raise ValueError(f"pack: {len(rows)} {level} crops do not fit in {k} slots")
        for name, fill in ((f.pixels, 0), (f.tokens, 0), (f.labels, -1)):
            src = np.asarray(batch[name])[mask]
            dst = np.full((k, *src.shape[1:]), fill, src.dtype)
            dst[:len(src)] = src
            out[name] = dst
        out[f.mask] = np.arange(k) < len(rows)
        out[f.segments] = np.full((k,), PAD_SEGMENT, np.int32)
        out[f.segments][:len(rows)] = rows
    return out


def grow(batch: dict, sizes: PackedSizes, tier: int) -> dict:
    """A packed batch padded to `tier`'s sizes (a larger or equal tier than its own)."""
    out = dict(batch)
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        k, have = sizes.slots(level, tier), len(batch[f.mask])
        if k < have:
            raise ValueError(f"grow: tier {tier} has {k} {level} slots, the batch {have}")
        for name, fill in ((f.pixels, 0), (f.tokens, 0), (f.labels, -1), (f.mask, False),
                           (f.segments, PAD_SEGMENT)):
            src = np.asarray(batch[name])
            dst = np.full((k, *src.shape[1:]), fill, src.dtype)
            dst[:have] = src
            out[name] = dst
    return out


def offset_segments(batch: dict, offset: int) -> dict:
    """A host's packed batch with its image indices moved by `offset` (the host's first image in
    the global batch); padding stays `PAD_SEGMENT`."""
    out = dict(batch)
    for level in fields.CROP_LEVELS:
        f = fields.LEVEL_FIELDS[level]
        seg = np.asarray(batch[f.segments])
        out[f.segments] = np.where(seg >= 0, seg + offset, seg).astype(np.int32)
    return out
