"""ScenarioCLIP's losses as pure functions (docs/design.md, section 2; appendix Eq. 8).

One function per equation: `clip_contrastive` (the per-level InfoNCE), `kd_term` (Eq. 8, one
teacher / student pair of embeddings), the two KD directions built on it, and
`scenarioclip_total` (L_total = lambda_CA * sum of the levels' InfoNCE + lambda_KD * L_KD) over
embeddings the train step has already computed. Everything is computed in float32 whatever the
embeddings' dtype. Masks select the valid rows / entries of the static-shape batches
(`sclaro_jax.data.batch`); padding never contributes. The crop levels come in either layout:
caps ([B, N] per image) or packed ([K] crops of the whole batch with `segment_ids`, the image
index of each crop; the KD terms' per-image means are then segment reductions).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sclaro_jax.ops import l2_normalize
from sclaro_jax.recipes import KD_DIRECTIONS, TEACHER_PROB_FLOOR

MAX_LOGIT_SCALE = 100.0
TEACHER_TEMPERATURE = 0.07
LEVELS = ("global", "object", "relation")
CROP_LEVELS = ("object", "relation")


def clip_contrastive(image_emb: jax.Array, text_emb: jax.Array, logit_scale: jax.Array,
                     mask: jax.Array | None = None, labels: jax.Array | None = None) -> jax.Array:
    """CLIP's symmetric InfoNCE over the valid rows: 0.5 * (CE_i2t + CE_t2i).

    image_emb, text_emb [N, D] (row i of each is a positive pair); logit_scale [] is the log of
    the scale, used as min(exp(logit_scale), 100); mask [N] bool marks valid rows (invalid rows
    are neither queries nor candidates). `labels` [N] int (optional, duplicate-aware): a
    candidate with the same label as the query, other than the query's own pair, is left out of
    the softmax instead of counting as a negative (the reference counts it as a negative).
    Returns the mean over valid rows (0 when there are none).
    """
    n = image_emb.shape[0]
    mask = jnp.ones((n,), bool) if mask is None else mask.astype(bool)
    scale = jnp.minimum(jnp.exp(logit_scale.astype(jnp.float32)), MAX_LOGIT_SCALE)
    logits = scale * (l2_normalize(image_emb) @ l2_normalize(text_emb).T)  # [N, N] i2t
    allowed = mask[:, None] & mask[None, :]
    if labels is not None:
        same = labels[:, None] == labels[None, :]
        allowed &= ~same | jnp.eye(n, dtype=bool)
    neg = jnp.finfo(jnp.float32).min
    diag = jnp.diagonal(logits)
    ce_i2t = jax.nn.logsumexp(jnp.where(allowed, logits, neg), axis=1) - diag
    ce_t2i = jax.nn.logsumexp(jnp.where(allowed, logits, neg), axis=0) - diag
    per_row = 0.5 * (ce_i2t + ce_t2i)
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, per_row, 0.0)) / jnp.maximum(count, 1)


def student_temperature(log_scale: jax.Array) -> jax.Array:
    """T_s = 1 / clip(exp(l), 1, 100): the learnable KD temperature (l init ln(1/0.07))."""
    return 1.0 / jnp.clip(jnp.exp(log_scale.astype(jnp.float32)), 1.0, MAX_LOGIT_SCALE)


def kd_term(teacher: jax.Array, student: jax.Array, log_scale: jax.Array,
            teacher_temp: float = TEACHER_TEMPERATURE,
            teacher_floor: float = TEACHER_PROB_FLOOR) -> jax.Array:
    """Appendix Eq. 8: T_s^2 * KL(softmax(z_t / T_t) || softmax(z_s / T_s)) / D over the last
    axis (broadcasting teacher against student), with T_s = `student_temperature(log_scale)`.

    The division by D = the feature size is the reference's `KLDivLoss(reduction='batchmean')`
    applied to one 1-D embedding (batchmean divides by the first dimension, here the features).
    As the reference, the teacher's probabilities are clamped below at `teacher_floor` (1e-8,
    not renormalised: p_t = max(softmax(z_t / T_t), floor)); `teacher_floor=0` is Eq. 8 as
    written. No gradient reaches the teacher.
    """
    t_s = student_temperature(log_scale)
    teacher = jax.lax.stop_gradient(teacher.astype(jnp.float32))
    log_p_t = jax.nn.log_softmax(teacher / teacher_temp, axis=-1)
    if teacher_floor > 0:
        log_p_t = jnp.maximum(log_p_t, math.log(teacher_floor))
    log_p_s = jax.nn.log_softmax(student.astype(jnp.float32) / t_s, axis=-1)
    kl = jnp.sum(jnp.exp(log_p_t) * (log_p_t - log_p_s), axis=-1)
    return t_s ** 2 * kl / teacher.shape[-1]


def _mean_over_groups(terms: jax.Array, mask: jax.Array, segment_ids: jax.Array | None = None,
                      num_segments: int | None = None) -> jax.Array:
    """Mean over each image's valid entries, then over the images that have any: `terms` and
    `mask` [B, N] (caps), or [K] with `segment_ids` [K] naming each entry's image among
    `num_segments` (packed)."""
    mask = mask.astype(bool)
    terms = jnp.where(mask, terms, 0.0)
    if segment_ids is None:
        count = jnp.sum(mask, axis=1)
        per_image = jnp.sum(terms, axis=1) / jnp.maximum(count, 1)
    else:  # invalid entries go to an id past the last image, which segment_sum drops
        ids = jnp.where(mask, segment_ids, num_segments)
        count = jax.ops.segment_sum(mask.astype(jnp.int32), ids, num_segments)
        per_image = jax.ops.segment_sum(terms, ids, num_segments) / jnp.maximum(count, 1)
    has = count > 0
    return jnp.sum(jnp.where(has, per_image, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def _owner(segment_ids: jax.Array, mask: jax.Array, num_segments: int) -> jax.Array:
    """The image index of each packed entry, clipped into range (padding reads image 0)."""
    return jnp.clip(jnp.where(mask, segment_ids, 0), 0, num_segments - 1)


def kd_one_teacher_many_students(teacher: jax.Array, students: jax.Array, mask: jax.Array,
                                 log_scale: jax.Array, teacher_temp: float = TEACHER_TEMPERATURE,
                                 *, segment_ids: jax.Array | None = None,
                                 teacher_floor: float = TEACHER_PROB_FLOOR) -> jax.Array:
    """Vision KD (global -> object, global -> relation): teacher [B, D] (EMA global image
    embedding), students [B, N, D] (crop / region embeddings), mask [B, N]; or, packed,
    students [K, D] and mask [K] with `segment_ids` [K] (the image of each crop). No gradient
    reaches the teacher."""
    if segment_ids is None:
        terms = kd_term(teacher[:, None, :], students, log_scale, teacher_temp, teacher_floor)
        return _mean_over_groups(terms, mask)
    b = teacher.shape[0]
    terms = kd_term(teacher[_owner(segment_ids, mask, b)], students, log_scale, teacher_temp,
                    teacher_floor)
    return _mean_over_groups(terms, mask, segment_ids, b)


def kd_many_teachers_one_student(teachers: jax.Array, mask: jax.Array, student: jax.Array,
                                 log_scale: jax.Array, teacher_temp: float = TEACHER_TEMPERATURE,
                                 *, segment_ids: jax.Array | None = None,
                                 teacher_floor: float = TEACHER_PROB_FLOOR) -> jax.Array:
    """Text KD (object -> global, relation -> global): teachers [B, N, D] (EMA object / relation
    text embeddings), mask [B, N], student [B, D] (global action text embedding); or, packed,
    teachers [K, D] and mask [K] with `segment_ids` [K]. No gradient reaches the teachers."""
    if segment_ids is None:
        terms = kd_term(teachers, student[:, None, :], log_scale, teacher_temp, teacher_floor)
        return _mean_over_groups(terms, mask)
    b = student.shape[0]
    terms = kd_term(teachers, student[_owner(segment_ids, mask, b)], log_scale, teacher_temp,
                    teacher_floor)
    return _mean_over_groups(terms, mask, segment_ids, b)


def scenarioclip_total(embeddings: dict, masks: dict, logit_scales: dict, *,
                       lambda_ca: float = 1.0, lambda_kd: float = 1.0,
                       kd_log_scale: jax.Array | None = None,
                       teacher_image: jax.Array | None = None,
                       teacher_texts: dict | None = None, kd_direction: str = "both",
                       labels: dict | None = None, segments: dict | None = None,
                       kd_teacher_floor: float = TEACHER_PROB_FLOOR) -> tuple[jax.Array, dict]:
    """L_total = lambda_CA * (L_global + L_object + L_relation) + lambda_KD * L_KD
    (docs/design.md, section 2), from embeddings already computed.

    embeddings: level -> (image [B, D] or [B, N, D], text of the same shape); masks: level ->
    [B] (global: valid images with an action) or [B, N] (valid crops of valid images);
    `segments` (the packed layout): crop level -> [K] image index of each crop, the crop
    levels' embeddings then [K, D] and their masks [K] (labels [K] too);
    logit_scales: level -> the log scale []. `labels` (duplicate-aware, optional): level ->
    [B, N] int labels for the crop levels. KD (when `kd_log_scale` is given and lambda_kd is
    not 0): `teacher_image` [B, D] (the EMA global image embedding) distils into the crop
    image embeddings ("vision", Eq. 8 via `kd_one_teacher_many_students`); `teacher_texts`
    level -> [B, N, D] (EMA crop text embeddings) distil into the global action text ("text",
    via `kd_many_teachers_one_student`; images without an action sit these terms out).
    `kd_direction` picks "both", "vision" or "text"; `kd_teacher_floor` the teacher
    probabilities' floor (`kd_term`). Returns (total, metrics): loss, loss_ca,
    loss_kd, loss_<level>, logit_scale_<level> and, with KD, kd_temperature.
    """
    if kd_direction not in KD_DIRECTIONS:
        raise ValueError(f"kd_direction {kd_direction!r} is not one of {KD_DIRECTIONS}")
    metrics = {}
    l_ca = 0.0
    for level in LEVELS:
        img, txt = embeddings[level]
        d = img.shape[-1]
        level_labels = None if labels is None or level not in labels else labels[level].reshape(-1)
        loss = clip_contrastive(img.reshape(-1, d), txt.reshape(-1, d), logit_scales[level],
                                masks[level].reshape(-1), level_labels)
        metrics[f"loss_{level}"] = loss
        metrics[f"logit_scale_{level}"] = jnp.exp(logit_scales[level])
        l_ca = l_ca + loss
    l_kd = jnp.zeros((), jnp.float32)
    segments = segments or {}
    if kd_log_scale is not None and lambda_kd:
        if kd_direction in ("both", "vision"):
            for level in CROP_LEVELS:
                l_kd += kd_one_teacher_many_students(teacher_image, embeddings[level][0],
                                                     masks[level], kd_log_scale,
                                                     segment_ids=segments.get(level),
                                                     teacher_floor=kd_teacher_floor)
        if kd_direction in ("both", "text"):
            # The student is the action text: images without an action sit these terms out.
            for level in CROP_LEVELS:
                seg = segments.get(level)
                with_action = (masks["global"][:, None] if seg is None else masks["global"][
                    _owner(seg, masks[level], masks["global"].shape[0])])
                l_kd += kd_many_teachers_one_student(teacher_texts[level],
                                                     masks[level] & with_action,
                                                     embeddings["global"][1], kd_log_scale,
                                                     segment_ids=seg,
                                                     teacher_floor=kd_teacher_floor)
        metrics["kd_temperature"] = student_temperature(kd_log_scale)
    total = lambda_ca * l_ca + lambda_kd * l_kd
    metrics.update(loss=total, loss_ca=l_ca, loss_kd=l_kd)
    return total, metrics
