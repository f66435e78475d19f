"""Photometric augmentation on the accelerator: ColorJitter and GaussianBlur (docs/design.md,
section 2) as torchvision applies them to the reference code's PIL images.

The host draws the parameters (`augment.sample_params`) and every batch carries them
(`batch.PHOTOMETRIC`); `augment_batch` applies them inside the jitted step, uint8 in, uint8
out, static shapes: the global view gets its jitter then the blur, the object crops and
relation regions their sample's crop jitter (one decision and order, each level's factors; no
blur), as the reference transforms do. A view whose jitter is off keeps its pixels bit for
bit, and so does a global view with `blur_sigma=0`.

The target is torchvision's PIL path (`torchvision.transforms.functional` on a PIL image),
which quantises to uint8 after every op:
- brightness, contrast, saturation: PIL's `ImageEnhance`, `Image.blend(degenerate, image,
  factor)` with Blend.c's float32 arithmetic `in1 + factor * (in2 - in1)` truncated and
  clipped; degenerate = black, the grey level `int(mean(L) + 0.5)`, and the luma image L
  (ITU-R 601-2 in integers, Convert.c `L24 >> 16`) respectively;
- hue: PIL's 8-bit HSV (Convert.c rgb2hsv / hsv2rgb), `int(factor * 255) % 256` added to H.
On the CPU backend each op equals torchvision bit for bit (tests/test_photometric.py: the HSV
conversions over all 2^24 inputs, Blend.c over all pixel pairs, each op, the chain and the blur
on photographs); other backends are not yet checked against it.

Which ops come from dm-pix (0.4.5) and which are jnp, and why:
- GaussianBlur: `dm_pix.gaussian_blur(reflect-padded image, sigma, 9, padding="VALID")`. Its
  kernel is torchvision's, exp(-x^2 / (2 sigma^2)) over x = -4..4 normalised (equal within
  1e-8); torchvision's reflect padding is `jnp.pad(mode="reflect")`. It convolves separably
  where torchvision uses the 2-D outer product, so a sum may round to the other side of .5
  (at most 1 grey level); rounded half to even like torch.round.
- brightness: jnp. `dm_pix.adjust_brightness` adds a delta; torchvision multiplies (a blend
  with black).
- contrast: jnp. `dm_pix.adjust_contrast` pulls each channel towards its own float mean;
  torchvision pulls all three towards one integer grey level, the rounded mean of PIL's
  integer luma (5-12 grey levels apart on the test photographs at factor 1.2).
- saturation: jnp. `dm_pix.adjust_saturation` scales S in float HSV (clipped at 1);
  torchvision blends with the luma image, channels clipped at 0 and 255 (13-22 apart).
- hue: jnp. `dm_pix.adjust_hue` rotates the hue in float HSV; PIL quantises H, S and V to 8
  bits (4-8 apart). torchvision's uint8 tensor path also works in float HSV and is as far
  from its PIL path, which is why the PIL path is the target.
- Every op rounds to uint8 after itself, as PIL does; dm-pix's ops stay in float.

Exactness under XLA: the steps of Pillow's C code that compute in double (H and S of rgb2hsv,
hsv2rgb's remainder and S / 255) are tables built on the host with the C code's float32 and
double arithmetic in numpy (`_hsv_tables`), so rgb_to_hsv is integer-only: a float32
transcription misses H by one on 72,036 of the 2^24 colours, and XLA compiles a division by a
constant as a multiplication, which moves the last bit the truncation sees. The blends keep
their product a separately rounded float32 (`_unfused`): XLA contracts `d + f * (x - d)` into
an FMA (one rounding where Blend.c has two; then 2,151 of 2.6e8 (pixel pair, factor) cases
land one grey level off).
The jitter's `order` must be a permutation of 0..3, as the host draws it.
"""

from __future__ import annotations

import dm_pix
import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax.data import batch as fields

KERNEL_SIZE = 9
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)


# ---- host tables: Pillow's Convert.c arithmetic (float and double as the C code has them) ----

def _pil_rgb2hsv_hs(r: np.ndarray, g: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """(H, S) of Pillow's rgb2hsv_row for integer arrays r, g, b, in numpy with the C types:
    float32 ratios, the hue's `fmod(h / 6.0 + 1.0, 1.0)` in double, truncation to int."""
    f32, f64 = np.float32, np.float64
    r, g, b = (np.asarray(c, np.int64) for c in (r, g, b))
    maxc, minc = np.maximum(r, np.maximum(g, b)), np.minimum(r, np.minimum(g, b))
    grey = maxc == minc
    cr = np.where(grey, 1, maxc - minc).astype(f32)
    s = cr / np.where(maxc == 0, 1, maxc).astype(f32)
    rc, gc, bc = ((maxc - c).astype(f32) / cr for c in (r, g, b))
    h = np.where(r == maxc, bc - gc,
                 np.where(g == maxc, (2.0 + rc.astype(f64) - bc).astype(f32),
                          (4.0 + gc.astype(f64) - rc).astype(f32)))
    h = np.fmod(h.astype(f64) / 6.0 + 1.0, 1.0).astype(f32)
    uh = np.clip((h.astype(f64) * 255.0).astype(np.int64), 0, 255)
    us = np.clip((s.astype(f64) * 255.0).astype(np.int64), 0, 255)
    return np.where(grey, 0, uh).astype(np.uint8), np.where(grey, 0, us).astype(np.uint8)


def _hsv_tables() -> dict[str, np.ndarray]:
    """hue: [3 * 256 * 256] H by (branch, d1, d2): branch 0 when R is the max (d1 = max - G,
    d2 = max - B), 1 when G is (max - R, max - B), 2 otherwise (max - R, max - G); H depends
    on the colour only through these. sat: [256 * 256] S by (max - min, max). frac, fs: [256]
    hsv2rgb's float32 `h * 6.0 / 255.0 - i` by H and `s / 255.0` by S."""
    d1, d2 = (a.ravel() for a in np.meshgrid(np.arange(256), np.arange(256), indexing="ij"))
    top = np.full_like(d1, 255)
    hue = np.concatenate([_pil_rgb2hsv_hs(top, top - d1, top - d2)[0],
                          _pil_rgb2hsv_hs(top - d1, top, top - d2)[0],
                          _pil_rgb2hsv_hs(top - d1, top - d2, top)[0]])
    span, maxc = d1, d2
    sat = _pil_rgb2hsv_hs(maxc, np.maximum(maxc - span, 0), np.maximum(maxc - span, 0))[1]
    sat = np.where(span <= maxc, sat, 0).astype(np.uint8)
    x = np.arange(256, dtype=np.float64) * 6.0 / 255.0
    frac = (x - np.floor(x)).astype(np.float32)
    fs = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    return dict(hue=hue, sat=sat, frac=frac, fs=fs)


_TABLES = _hsv_tables()


# ---- the four ColorJitter ops, one image [..., H, W, 3] uint8 each ----

def luma(image: jax.Array) -> jax.Array:
    """PIL's L of an RGB uint8 image: (19595 R + 38470 G + 7471 B + 0x8000) >> 16, int32."""
    c = image.astype(jnp.int32)
    return (c[..., 0] * 19595 + c[..., 1] * 38470 + c[..., 2] * 7471 + 0x8000) >> 16


def _unfused(product: jax.Array) -> jax.Array:
    """`product` as a separately rounded float32: the select keeps XLA from fusing the sum that
    follows into an FMA (Blend.c rounds the product, then the sum). NaN never occurs."""
    return jnp.where(product == product, product, 0.0)


def _blend(degenerate: jax.Array, image: jax.Array, factor) -> jax.Array:
    """Pillow's Image.blend(degenerate, image, factor) on uint8 pixels (Blend.c): the float32
    `in1 + factor * (in2 - in1)`, truncated, clipped to 0..255."""
    d = degenerate.astype(jnp.float32)
    out = d + _unfused(jnp.float32(factor) * (image.astype(jnp.float32) - d))
    return jnp.clip(jnp.floor(out), 0, 255).astype(jnp.uint8)


def _grey_level(lum: jax.Array) -> jax.Array:
    """ImageEnhance.Contrast's grey level int(mean(L) + 0.5) of luma images [..., H, W], in
    exact integers (int32: images up to 2^22 pixels)."""
    n = lum.shape[-1] * lum.shape[-2]
    return (2 * jnp.sum(lum, axis=(-2, -1)) + n) // (2 * n)


def adjust_brightness(image: jax.Array, factor) -> jax.Array:
    """torchvision's PIL adjust_brightness (a blend with black) on uint8 [..., H, W, 3]."""
    return _blend(jnp.zeros((), jnp.int32), image, factor)


def adjust_contrast(image: jax.Array, factor) -> jax.Array:
    """torchvision's PIL adjust_contrast (a blend with the image's grey level)."""
    return _blend(_grey_level(luma(image))[..., None, None, None], image, factor)


def adjust_saturation(image: jax.Array, factor) -> jax.Array:
    """torchvision's PIL adjust_saturation (a blend with the luma image)."""
    return _blend(luma(image)[..., None], image, factor)


def rgb_to_hsv(image: jax.Array) -> jax.Array:
    """PIL's RGB -> HSV conversion (8 bits each), from the host tables; integer-only."""
    c = image.astype(jnp.int32)
    r, g, b = c[..., 0], c[..., 1], c[..., 2]
    maxc = jnp.maximum(r, jnp.maximum(g, b))
    minc = jnp.minimum(r, jnp.minimum(g, b))
    branch = jnp.where(r == maxc, 0, jnp.where(g == maxc, 1, 2))
    d1 = maxc - jnp.where(branch == 0, g, r)
    d2 = maxc - jnp.where(branch == 2, g, b)
    h = jnp.asarray(_TABLES["hue"])[branch * 65536 + d1 * 256 + d2]
    s = jnp.asarray(_TABLES["sat"])[(maxc - minc) * 256 + maxc]
    return jnp.stack([h, s, maxc.astype(jnp.uint8)], axis=-1)


def hsv_to_rgb(hsv: jax.Array) -> jax.Array:
    """PIL's HSV -> RGB conversion (Convert.c hsv2rgb): sector i = floor(6 H / 255), the
    remainder and S / 255 from the host tables, round(V (1 - ...)) in float32 (the same
    integers as the C code's doubles for every input: tests/test_photometric.py)."""
    c = hsv.astype(jnp.int32)
    h, s, v = c[..., 0], c[..., 1], c[..., 2]
    sector = (h * 6 // 255) % 6
    f = jnp.asarray(_TABLES["frac"])[h]
    fs = jnp.asarray(_TABLES["fs"])[s]
    vf = v.astype(jnp.float32)

    def rnd(x):
        return jnp.clip(jnp.floor(vf * x + 0.5), 0, 255).astype(jnp.int32)

    p, q, t = rnd(1.0 - fs), rnd(1.0 - fs * f), rnd(1.0 - fs * (1.0 - f))
    red = jnp.select([sector == k for k in range(5)], [v, q, p, p, t], v)
    green = jnp.select([sector == k for k in range(5)], [t, v, v, q, p], p)
    blue = jnp.select([sector == k for k in range(5)], [p, p, t, v, v], q)
    rgb = jnp.stack([red, green, blue], axis=-1)
    return jnp.where((s == 0)[..., None], v[..., None], rgb).astype(jnp.uint8)


def hue_shift(factor) -> jax.Array:
    """torchvision's `np.int32(factor * 255)` mod 256 for a float32 factor in [-0.5, 0.5]:
    trunc(|f| * 255) in float32 is exact there: for k = 1..127 the float32 nearest below k / 255
    is (j / 255) of its spacing below it with j >= 128, so its product with 255 stays more than
    half a float32 spacing below k and cannot round up onto k (tests check every factor near
    every k / 255)."""
    a = jnp.abs(jnp.asarray(factor, jnp.float32))
    k = jnp.floor(a * 255.0).astype(jnp.int32)
    return jnp.mod(jnp.where(factor < 0, -k, k), 256)


def adjust_hue(image: jax.Array, factor) -> jax.Array:
    """torchvision's PIL adjust_hue: to PIL's HSV, add the shift to H (mod 256), back to RGB.
    Like torchvision, a factor of 0 still makes the (lossy) HSV round trip."""
    hsv = rgb_to_hsv(image).astype(jnp.int32)
    h = jnp.mod(hsv[..., 0] + hue_shift(factor), 256)
    return hsv_to_rgb(jnp.concatenate([h[..., None], hsv[..., 1:]], axis=-1))


def _blend_op(image: jax.Array, op, factor) -> jax.Array:
    """Brightness, contrast or saturation of one image by op index (a traced scalar): the
    three are one blend with another degenerate image."""
    lum = luma(image)
    degenerate = jnp.where(op == BRIGHTNESS, 0, jnp.where(op == CONTRAST, _grey_level(lum), lum))
    return _blend(degenerate[..., None], image, factor)


def color_jitter(image: jax.Array, order: jax.Array, factors: jax.Array) -> jax.Array:
    """torchvision ColorJitter on one [H, W, 3] uint8 image with its drawn parameters: `order`
    a permutation of the op indices (0 brightness, 1 contrast, 2 saturation, 3 hue), `factors`
    [4] by op index. The hue runs once, between two loops over the blend slots (those before
    it, those after it), so the traced work is six blends and one hue whatever the order and
    each loop body compiles once."""
    order = order.astype(jnp.int32)
    factors = factors.astype(jnp.float32)
    hue_at = jnp.argmax(order == HUE)

    def slot(active):
        def body(k, x):
            op = order[k]
            return jnp.where(active(k), _blend_op(x, op, factors[op]), x)
        return body

    x = jax.lax.fori_loop(0, 3, slot(lambda k: k < hue_at), image)
    x = adjust_hue(x, factors[HUE])
    return jax.lax.fori_loop(1, 4, slot(lambda k: k > hue_at), x)


def gaussian_blur(image: jax.Array, sigma) -> jax.Array:
    """torchvision GaussianBlur(kernel 9) on one [H, W, 3] uint8 image: reflect padding,
    `dm_pix.gaussian_blur` with padding "VALID", rounded half to even. sigma <= 0: unchanged."""
    r = KERNEL_SIZE // 2
    on = sigma > 0
    x = jnp.pad(image.astype(jnp.float32), ((r, r), (r, r), (0, 0)), mode="reflect")
    y = dm_pix.gaussian_blur(x, jnp.where(on, sigma, 1.0), KERNEL_SIZE, padding="VALID")
    y = jnp.clip(jnp.round(y), 0, 255).astype(jnp.uint8)
    return jnp.where(on, y, image)


def _sample_views(views, jitter, order, factors, sigma):
    """One sample's views [V, S, S, 3] (view 0 the global one) with each view's jitter draw
    (`jitter` [V], `order` [V, 4], `factors` [V, 4]), then the blur on view 0."""
    jittered = jax.vmap(color_jitter)(views, order, factors)
    views = jnp.where(jitter[:, None, None, None], jittered, views)
    return views.at[0].set(gaussian_blur(views[0], sigma))


_batch_views = jax.jit(jax.vmap(_sample_views))


def _level_draws(batch) -> dict[str, tuple]:
    """Level -> its (decision [B], order [B, 4], factors [B, 4]): the global view's own draw;
    the object crops and relation regions one decision and order, each level's factors."""
    def get(name, dtype):
        return jnp.asarray(batch[name]).astype(dtype)

    crop_jitter = get(fields.CROP_JITTER, bool)
    crop_order = get(fields.CROP_JITTER_ORDER, jnp.int32)
    return {"global": (get(fields.JITTER, bool), get(fields.JITTER_ORDER, jnp.int32),
                       get(fields.JITTER_FACTORS, jnp.float32)),
            "object": (crop_jitter, crop_order, get(fields.OBJECT_JITTER_FACTORS, jnp.float32)),
            "relation": (crop_jitter, crop_order,
                         get(fields.RELATION_JITTER_FACTORS, jnp.float32))}


def has_fields(batch) -> bool:
    """Whether `batch` carries the photometric parameters (`batch.PHOTOMETRIC`)."""
    return all(name in batch for name, _, _ in fields.PHOTOMETRIC)


def augment_batch(batch: dict) -> dict:
    """The batch with ColorJitter and GaussianBlur applied to the pixels of the three levels
    (`batch.LEVEL_FIELDS[...].pixels`, uint8): global views their jitter then the blur, object and
    relation views their sample's crop jitter at their level's factors. Other fields are
    returned as they are; a batch without the PHOTOMETRIC fields is returned unchanged. Either
    crop layout: caps ([B, N] views) or packed ([K] views, each with its image index in
    `*_segments`; padding slots get image 0's draw, and stay padding). Traceable (call it inside
    the jitted step)."""
    if not has_fields(batch):
        return batch
    for level, f in fields.LEVEL_FIELDS.items():
        dtype = batch[f.pixels].dtype
        if dtype != jnp.uint8:
            raise TypeError(f"photometric.augment_batch: batch field {f.pixels!r} ({level} "
                            f"level) is {dtype}, not uint8; the augmentation works on the "
                            "pipeline's uint8 pixels (PipelineConfig(pixels='uint8'))")
    draws = _level_draws(batch)
    sigma = jnp.asarray(batch[fields.BLUR_SIGMA]).astype(jnp.float32)
    crops = [fields.LEVEL_FIELDS[level] for level in fields.CROP_LEVELS]
    out = dict(batch)
    if crops[0].segments in batch:  # packed: every view of the batch in one row of views
        b = sigma.shape[0]
        owners = [jnp.arange(b)] + [jnp.clip(jnp.asarray(batch[f.segments]), 0, b - 1)
                                    for f in crops]
        per_view = [jnp.concatenate([d[i][owner] for d, owner in
                                     zip(draws.values(), owners)]) for i in range(3)]
        views = jnp.concatenate([jnp.asarray(batch[fields.IMAGE])]
                                + [jnp.asarray(batch[f.pixels]) for f in crops])
        views = _packed_views(views, *per_view, sigma)
        out[fields.IMAGE] = views[:b]
        start = b
        for f in crops:
            count = batch[f.pixels].shape[0]
            out[f.pixels] = views[start:start + count]
            start += count
        return out
    # The three levels' views of a sample side by side, so the jitter compiles once.
    counts = [1] + [batch[f.pixels].shape[1] for f in crops]
    views = jnp.concatenate([jnp.asarray(batch[fields.IMAGE])[:, None]]
                            + [jnp.asarray(batch[f.pixels]) for f in crops], axis=1)
    per_view = [jnp.concatenate([jnp.repeat(d[i][:, None], n, axis=1)
                                 for d, n in zip(draws.values(), counts)], axis=1)
                for i in range(3)]
    views = _batch_views(views, *per_view, sigma)
    out[fields.IMAGE] = views[:, 0]
    start = 1
    for f in crops:
        count = batch[f.pixels].shape[1]
        out[f.pixels] = views[:, start:start + count]
        start += count
    return out


@jax.jit
def _packed_views(views, jitter, order, factors, sigma):
    """Views [V, S, S, 3] of the packed layout, the B global views first, each with its jitter
    draw (`jitter` [V], `order` [V, 4], `factors` [V, 4]), then the blur on the global views."""
    jittered = jax.vmap(color_jitter)(views, order, factors)
    views = jnp.where(jitter[:, None, None, None], jittered, views)
    b = sigma.shape[0]
    return views.at[:b].set(jax.vmap(gaussian_blur)(views[:b], sigma))
