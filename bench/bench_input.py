"""Input pipeline throughput: sclaro_jax's Grain pipeline on stored training views (schema
version 2) and on originals (version 1), vs the reference's PyTorch DataLoader.

The same samples (8 objects + 8 relations each, 640x480 JPEG photographs, focused-region JPEGs
made with `data_prep.focus`, batch 16, 224 px outputs) are written twice: as version-1 records
(originals only) and as version-2 records (`data_prep.views.with_views`: stored 224 px object and
relation views, the photograph at 290 px on its shorter side, no originals). Each pipeline runs
in this process pinned to one core (`os.sched_setaffinity`; `worker_count=0`, `num_workers=0`,
torch.set_num_threads(1)), so samples/s is per core; Grain's record-reading threads share it.

- ours, v2: `make_loader` on the version-2 records: decode the stored views (simplejpeg when
  installed, `sclaro_jax.data.decode`), RandomResizedCrop of the stored global image, memoised
  tokens, photometric parameters as batch fields (applied on the accelerator), uint8 out.
- ours, v1: the same pipeline on the version-1 records (views made from the originals on the
  host: full decode, box crops, Resize + CenterCrop, reduced-scale JPEG decode of the regions).
- reference: a torch `Dataset` doing what the reference code does per sample on the version-1
  records: PIL decode of the image and of every relation region, `image.crop(box)` per object,
  torchvision RandomResizedCrop/ColorJitter/GaussianBlur (global) and
  Resize/CenterCrop/ColorJitter (objects, relations), ToTensor + Normalize, and a collate that
  tokenises the 17 texts with transformers' CLIPTokenizer (max_length 77).

Rounds alternate the order of the pipelines; each times one batch of each, in wall-clock
seconds and in CPU seconds of this process and its children (`samples per CPU-second` is what
one core does for the pipeline when nothing else runs on it; on a shared machine the wall
figure also counts other programs' time on that core). Then the JPEG decoders on the stored
views (and simplejpeg on the same views in other JPEG settings), a per-stage profile of the v2
path (each stage alone over the same records, CPU time), and with `--workers N` Grain with N
worker processes on N cores against 1 worker process on 1 core (the main process shares those
cores). `--tune` sweeps Grain's read options and the worker buffer.

    python bench/bench_input.py --rounds 12
    python bench/bench_input.py --rounds 6 --workers 2 --tune
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ["person", "dog", "ball", "chair", "table", "cup", "tree", "car"]


def build_shards(out: str, n_samples: int, n_obj: int = 8, n_rel: int = 8,
                 view_size: int | None = None, demo_counts: bool = False) -> None:
    """Samples with n_obj objects / n_rel relations on 640x480 JPEGs of the demo photographs
    (`demo_counts`: each with its photograph's own object / relation counts, at most n_obj /
    n_rel); version-1 records, or with `view_size` version-2 records (views at that size, no
    originals) made by the writer (`data_prep.views.with_views`)."""
    from data_prep import demo, focus
    from sclaro_jax.data.images import box_mask, encode_jpeg
    from data_prep.shards import ShardWriter
    from sclaro_jax.data import schema

    rng = np.random.default_rng(0)
    photos = []
    for entry in demo.load_annotations():
        img = Image.open(demo.image_path(entry)).convert("RGB")
        img = img.resize((640, 480), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        k_obj, k_rel = n_obj, n_rel
        if demo_counts:
            k_obj = max(1, min(n_obj, len(entry["objects"])))
            k_rel = min(n_rel, len(entry["relations"]))
        boxes = []
        for _ in range(k_obj):
            w, h = rng.integers(60, 400), rng.integers(60, 320)
            x0, y0 = rng.integers(0, 640 - w), rng.integers(0, 480 - h)
            boxes.append((float(x0), float(y0), float(x0 + w), float(y0 + h)))
        rgb = np.asarray(img)
        regions = []
        for k in range(k_rel):
            a, b = k % k_obj, (k + 1) % k_obj
            region = focus.focused_region(rgb, box_mask(boxes[a], 640, 480),
                                          box_mask(boxes[b], 640, 480))
            regions.append((a, b, encode_jpeg(region, 90)))
        photos.append((buf.getvalue(), boxes, regions))
    with ShardWriter(out, records_per_shard=64, view_size=view_size) as w:
        for i in range(n_samples):
            data, boxes, regions = photos[i % len(photos)]
            objects = tuple(schema.Object(NAMES[(i + k) % len(NAMES)], box)
                            for k, box in enumerate(boxes))
            relations = tuple(
                schema.Relation(a, "next to", b, schema.triplet_text(
                    objects[a].name, "next to", objects[b].name), region)
                for a, b, region in regions)
            sample = schema.Sample(id=f"bench{i:05d}", source="bench", split="train",
                                   image=data, width=640, height=480,
                                   action=["playing", "sitting"][i % 2], caption="",
                                   objects=objects, relations=relations, mask_kind="box")
            w.add(sample)  # the writer makes the views (`data_prep.views.with_views`)


class ReferenceDataset:
    """The reference code's per-sample work, on the same records (torch + torchvision + PIL)."""

    def __init__(self, paths):
        import grain.python as grain
        import torchvision.transforms as T

        self.source = grain.ArrayRecordDataSource(paths)
        norm = T.Normalize((0.48145466, 0.4578275, 0.40821073),
                           (0.26862954, 0.26130258, 0.27577711))
        def jitter(b, h):
            return T.RandomApply([T.ColorJitter(b, b, b, h)], p=0.2)

        bicubic = T.InterpolationMode.BICUBIC
        self.global_tf = T.Compose([
            T.RandomResizedCrop(224, scale=(0.8, 1.0), interpolation=bicubic), jitter(0.2, 0.05),
            T.RandomApply([T.GaussianBlur(9, (0.1, 1.5))], p=0.1), T.ToTensor(), norm])
        self.object_tf, self.relation_tf = (
            T.Compose([T.Resize(224, interpolation=bicubic), T.CenterCrop(224), jitter(b, h),
                       T.ToTensor(), norm]) for b, h in ((0.15, 0.03), (0.10, 0.02)))

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        import torch

        from sclaro_jax.data import schema

        s = schema.decode(self.source[i])
        image = Image.open(io.BytesIO(s.image)).convert("RGB")
        objects = torch.stack([self.object_tf(image.crop(o.box)) for o in s.objects])
        relations = torch.stack([
            self.relation_tf(Image.open(io.BytesIO(r.region)).convert("RGB"))
            for r in s.relations])
        return (self.global_tf(image), objects, relations, s.action,
                [o.name for o in s.objects], [r.text for r in s.relations])


def reference_collate(tokenizer):
    def collate(items):
        import torch
        images, objects, relations, actions, names, texts = zip(*items)

        def tok(t):
            return tokenizer(list(t), padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt")["input_ids"]
        return (torch.stack(images), torch.stack(objects), torch.stack(relations), tok(actions),
                tok([n for ns in names for n in ns]), tok([t for ts in texts for t in ts]))
    return collate


def forever(make_iter):
    while True:
        yield from make_iter()


def pin(cores) -> None:
    """Pin this process (and the threads and processes it starts afterwards) to `cores`."""
    os.sched_setaffinity(0, set(cores))


def cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads; `time.process_time`) and its live
    children (Grain's worker processes; psutil, in clock ticks of 10 ms)."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def paired(fns, rounds: int, pause: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(wall, CPU) seconds [rounds, len(fns)]: two warm-up calls each, then one call of each
    per round, the order flipping every round (drift in the machine's load hits all alike)."""
    for fn in fns:
        fn(), fn()
    wall, cpu = np.zeros((rounds, len(fns))), np.zeros((rounds, len(fns)))
    for r in range(rounds):
        for i in (range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))):
            time.sleep(pause)
            wall[r, i], cpu[r, i] = timed(fns[i])
    return wall, cpu


def _cpu_ms(fn, per: int, repeats: int = 5) -> float:
    """Least CPU milliseconds of fn() / per over `repeats` calls after one warm-up (the least
    is the figure least disturbed by other programs on a shared machine)."""
    fn()
    return 1e3 * min(timed(fn)[1] for _ in range(repeats)) / per


def _jpeg(pixels: np.ndarray, quality: int, subsampling: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality, subsampling=subsampling)
    return buf.getvalue()


def decoder_table(ds) -> None:
    """Least CPU ms per decode of the stored views and train images: PIL (with and without draft
    mode), simplejpeg, PyTurboJPEG; then simplejpeg on the same views in other JPEG settings."""
    import grain.python as grain

    from sclaro_jax.data import decode, schema

    source = grain.ArrayRecordDataSource(ds.paths("train"))
    samples = [schema.decode(source[i]) for i in range(min(14, len(source)))]
    stored = [r.view for s in samples for r in s.relations] + [o.view for s in samples
                                                               for o in s.objects]
    chroma = "4:2:0" if schema.view_subsampling(samples[0].view_size) == 2 else "4:4:4"
    setting = f"q{ds.manifest['view_quality']}, {chroma}"
    size = Image.open(io.BytesIO(samples[0].train_image)).size
    kinds = {f"stored {samples[0].view_size} px view ({setting})": stored,
             f"train_image ({size[0]}x{size[1]}, {setting})": [s.train_image for s in samples]}

    def pil(d):
        img = Image.open(io.BytesIO(d))
        img.load()
        return np.asarray(img)

    def pil_draft(d):  # draft picks a reduced DCT scale only for images >= 2x the request
        img = Image.open(io.BytesIO(d))
        img.draft("RGB", (224, 224))
        img.load()
        return np.asarray(img)

    decoders = {"PIL `Image.open().load()` + `np.asarray`": pil,
                "PIL with `draft('RGB', (224, 224))`": pil_draft}
    if decode.simplejpeg is not None:
        decoders["simplejpeg `decode_jpeg`"] = lambda d: decode.simplejpeg.decode_jpeg(d)
    try:
        import turbojpeg
        tj = turbojpeg.TurboJPEG()
        decoders["PyTurboJPEG"] = lambda d: tj.decode(d, pixel_format=turbojpeg.TJPF_RGB)
    except Exception as e:  # PyTurboJPEG needs the system libturbojpeg
        print(f"PyTurboJPEG not measured: {type(e).__name__}: {str(e).splitlines()[0]}")
    print("| decoder | " + " | ".join(f"{k}, ms" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name, fn in decoders.items():
        cells = [f"{_cpu_ms(lambda: [fn(d) for d in data], len(data), 7):.3f}"
                 for data in kinds.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    worst = max(int(np.abs(pil(d).astype(int) - decode.decode_array(d)).max())
                for data in kinds.values() for d in data)
    print(f"max |PIL - decode.decode_array| over these images: {worst} grey levels "
          f"(decode.decode_array uses {decode.backend_name()})")
    if decode.simplejpeg is None:
        return
    pixels = [pil(d) for d in stored]
    print("\nthe stored views re-encoded in other JPEG settings, simplejpeg (the difference is "
          "to the stored view's pixels; tests/test_reshard.py prints ours against the exact "
          "pixels):")
    print("| quality, chroma | bytes per view | ms per view | mean abs diff to the stored view |")
    print("|---|---|---|---|")
    for quality, sub, label in ((97, 2, "4:2:0"), (95, 0, "4:4:4"), (90, 0, "4:4:4"),
                                (95, 2, "4:2:0"), (90, 2, "4:2:0")):
        data = [_jpeg(x, quality, sub) for x in pixels]
        ms = _cpu_ms(lambda: [decode.simplejpeg.decode_jpeg(d) for d in data], len(data), 7)
        diff = np.mean([np.abs(decode.simplejpeg.decode_jpeg(d).astype(int) - x).mean()
                        for d, x in zip(data, pixels)])
        print(f"| {quality}, {label} | {np.mean([len(d) for d in data]):.0f} | {ms:.3f} | "
              f"{diff:.2f} |")


def stage_profile(ds, batch: int, batches: int, ms_per_sample: float) -> None:
    """CPU ms per sample of each stage of the v2 path alone, over the same records."""
    import grain.python as grain

    from sclaro_jax.data import augment, decode, schema
    from sclaro_jax.data.collate import collate
    from sclaro_jax.data.pipeline import PipelineConfig, SampleTransform

    cfg = PipelineConfig(max_objects=8, max_relations=8)
    source = grain.ArrayRecordDataSource(ds.paths("train"))
    n = min(len(source), batch * batches)
    rng = np.random.default_rng(0)
    transform = SampleTransform(cfg, ds.vocab)
    records = [source[i] for i in range(n)]
    samples = [schema.decode(r) for r in records]
    size = cfg.image_size
    images = [decode.decode_image(s.train_image) for s in samples]
    params = [augment.sample_params(rng, *img.size, train=True) for img in images]
    out = np.empty((16, size, size, 3), np.uint8)  # reused: the decodes alone

    def view_decodes():
        for s in samples:
            for k, v in enumerate([o.view for o in s.objects] + [r.view for r in s.relations]):
                decode.decode_array(v, out=out[k])

    def tokens():
        for s in samples:
            transform.text([s.action])
            transform.text([o.name for o in s.objects])
            transform.text([r.text for r in s.relations])

    examples = [transform.random_map(r, rng) for r in records]
    stages = {
        "record read (ArrayRecord)": lambda: [source[i] for i in range(n)],
        "msgpack decode + `schema.validate`": lambda: [
            schema.validate(schema.decode(r), decode_images=False) for r in records],
        "global view: decode train_image": lambda: [decode.decode_image(
            s.train_image, size=schema.train_image_size(s.width, s.height, s.view_size))
            for s in samples],
        "global view: RandomResizedCrop resample (PIL bicubic)": lambda: [
            augment.global_view(img, p, size) for img, p in zip(images, params)],
        "tokens (memoised)": tokens}
    ms = {name: _cpu_ms(fn, n) for name, fn in stages.items()}
    example = _cpu_ms(lambda: [transform.random_map(r, rng) for r in records], n)
    ms["rest of SampleTransform (params, labels, photometric fields)"] = example - sum(
        v for k, v in ms.items() if k != "record read (ArrayRecord)")
    ms["16 view decodes (in collate, into the batch)"] = _cpu_ms(view_decodes, n)
    whole = _cpu_ms(lambda: [collate(examples[b:b + batch], cfg)
                             for b in range(0, n - batch + 1, batch)], n // batch * batch)
    ms["rest of collate (batch arrays, tokens, labels)"] = (
        whole - ms["16 view decodes (in collate, into the batch)"])
    ms["Grain overhead (the loop minus the stages)"] = ms_per_sample - sum(ms.values())
    print(f"| stage (v2, one core) | CPU ms per sample | share of the loop's "
          f"{ms_per_sample:.2f} ms |")
    print("|---|---|---|")
    for name, v in ms.items():
        print(f"| {name} | {v:.2f} | {100 * v / ms_per_sample:.0f}% |")


def grain_rates(ds, batch: int, batches: int, cores, repeats: int = 3,
                **kw) -> tuple[float, float]:
    """(wall samples/s, samples per CPU-second) of our pipeline (v2 train config), the process
    pinned to `cores` (worker processes inherit it): medians over `repeats` stretches of
    `batches` batches, after 2 (or 2 per worker) untimed ones."""
    from sclaro_jax.data.pipeline import PipelineConfig, make_loader

    pin(cores)
    cfg = PipelineConfig(max_objects=8, max_relations=8)
    it = iter(make_loader(ds, "train", batch, config=cfg, seed=0, **kw))
    for _ in range(2 * max(1, kw.get("worker_count", 0))):
        next(it)
    wall, cpu = zip(*[timed(lambda: [next(it) for _ in range(batches)])
                      for _ in range(repeats)])
    if hasattr(it, "close"):
        it.close()
    return batches * batch / float(np.median(wall)), batches * batch / float(np.median(cpu))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=96, help="distinct records written")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--core", type=int, default=None,
                        help="the core to pin to (default: the last one this process may use)")
    parser.add_argument("--workers", type=int, default=0,
                        help="also time Grain with this many worker processes on as many cores "
                             "against 1 worker process on 1 core")
    parser.add_argument("--tune", action="store_true",
                        help="sweep read_threads / read_buffer (and worker_buffer_size)")
    args = parser.parse_args()

    import torch

    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if args.core is None else args.core
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_input_")
    try:
        run(args, tmp, allowed, core)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: str, allowed, core: int) -> None:
    import torch
    import transformers

    from sclaro_jax.data import decode
    from sclaro_jax.data.dataset import open_dataset
    from sclaro_jax.data.pipeline import PipelineConfig, make_loader
    from sclaro_jax.data.tokenizer import ClipTokenizer

    t0 = time.perf_counter()
    build_shards(os.path.join(tmp, "v1"), args.samples)
    build_shards(os.path.join(tmp, "v2"), args.samples, view_size=224)
    print(f"wrote {args.samples} records twice (v1, v2) in {time.perf_counter() - t0:.1f} s; "
          f"JPEG decoder: {decode.backend_name()}; pinned to core {core} of {allowed}; "
          f"load average {os.getloadavg()[0]:.1f}")
    pin([core])
    v1, v2 = open_dataset(os.path.join(tmp, "v1")), open_dataset(os.path.join(tmp, "v2"))
    ClipTokenizer().save_pretrained(os.path.join(tmp, "tok"))
    hf_tok = transformers.CLIPTokenizer.from_pretrained(os.path.join(tmp, "tok"))

    cfg = PipelineConfig(max_objects=8, max_relations=8)
    ours_v2 = iter(make_loader(v2, "train", args.batch, config=cfg, seed=0))
    ours_v1 = iter(make_loader(v1, "train", args.batch, config=cfg, seed=0))
    ref = forever(lambda: iter(torch.utils.data.DataLoader(
        ReferenceDataset(v1.paths("train")), batch_size=args.batch, shuffle=True,
        num_workers=0, collate_fn=reference_collate(hf_tok), drop_last=True)))
    b = next(ours_v2)
    print("ours:", {k: v.shape for k, v in b.items() if k in ("image", "objects", "relations")})
    print("reference:", [tuple(x.shape) for x in next(ref)[:3]])
    fns = [lambda: next(ours_v2), lambda: next(ours_v1), lambda: next(ref)]
    wall, cpu = paired(fns, args.rounds)
    print(f"\n{args.rounds} rounds of one batch of {args.batch}, 8 objects + 8 relations, "
          f"224 px, one core")
    print("| pipeline | s per batch, median (min) | samples/s | samples per CPU-second, "
          "median (best) | vs PyTorch (CPU) |")
    print("|---|---|---|---|---|")
    labels = ["sclaro_jax Grain, v2 records (stored views), uint8",
              "sclaro_jax Grain, v1 records (originals; today's path), uint8",
              "reference PyTorch DataLoader (v1 records)"]
    for i, label in enumerate(labels):
        vs = np.median(cpu[:, 2] / cpu[:, i])
        print(f"| {label} | {np.median(wall[:, i]):.3f} ({wall[:, i].min():.3f}) | "
              f"{args.batch / np.median(wall[:, i]):.1f} | "
              f"{args.batch / np.median(cpu[:, i]):.1f} ({args.batch / cpu[:, i].min():.1f}) "
              f"| {vs:.2f}x |")

    print("\nJPEG decoders (CPU ms per image, one core):")
    decoder_table(v2)
    print("\nper-stage profile of the v2 path (one core; least CPU time of 5 repeats, the "
          "loop's least batch):")
    stage_profile(v2, args.batch, 4, 1e3 * cpu[:, 0].min() / args.batch)

    n = 3 * args.rounds // 2
    if args.tune:
        print(f"\nGrain read options, worker_count=0, one core ({n} batches x 3, medians):")
        print("| read_threads | read_buffer | samples/s | samples per CPU-second |")
        print("|---|---|---|---|")
        for threads, buffer in ((0, 0), (1, 16), (2, 16), (16, 64), (16, 500)):
            w, c = grain_rates(v2, args.batch, n, [core], read_threads=threads,
                               read_buffer=buffer)
            print(f"| {threads} | {buffer} | {w:.1f} | {c:.1f} |")
    if args.workers:
        cores = allowed[-args.workers:] if len(allowed) >= args.workers else allowed
        print(f"\nGrain worker processes ({n} batches x 3 after warm-up, medians):")
        print("| worker processes | cores | worker_buffer_size | samples/s | vs 1 worker | "
              "samples per CPU-second (all processes) |")
        print("|---|---|---|---|---|---|")
        for buffer in ((1, 2) if args.tune else (2,)):
            one = grain_rates(v2, args.batch, n, [core], worker_count=1,
                              worker_buffer_size=buffer)
            many = grain_rates(v2, args.batch, n, cores, worker_count=args.workers,
                               worker_buffer_size=buffer)
            print(f"| 1 | 1 | {buffer} | {one[0]:.1f} | 1.00x | {one[1]:.1f} |")
            print(f"| {args.workers} | {len(cores)} | {buffer} | {many[0]:.1f} | "
                  f"{many[0] / one[0]:.2f}x | {many[1]:.1f} |")


if __name__ == "__main__":
    main()
