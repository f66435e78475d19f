"""ScenarioCLIP's losses as pure functions (DESIGN.md section 2, appendix Eq. 8).

Everything is computed in float32 whatever the embeddings' dtype. Masks select the valid rows /
entries of the static-shape batches (`sclaro_jax.data.pipeline`); padding never contributes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_LOGIT_SCALE = 100.0
TEACHER_TEMPERATURE = 0.07


def _l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-24))


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
    logits = scale * (_l2_normalize(image_emb) @ _l2_normalize(text_emb).T)  # [N, N] i2t
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


def _kd_terms(teacher: jax.Array, student: jax.Array, log_scale: jax.Array,
              teacher_temp: float) -> jax.Array:
    """T_s^2 * KL(softmax(z_t / T_t) || softmax(z_s / T_s)) / D over the last axis.

    The division by D = the feature size is the reference's `KLDivLoss(reduction='batchmean')`
    applied to one 1-D embedding (batchmean divides by the first dimension, here the features).
    """
    t_s = student_temperature(log_scale)
    teacher = jax.lax.stop_gradient(teacher.astype(jnp.float32))
    log_p_t = jax.nn.log_softmax(teacher / teacher_temp, axis=-1)
    log_p_s = jax.nn.log_softmax(student.astype(jnp.float32) / t_s, axis=-1)
    kl = jnp.sum(jnp.exp(log_p_t) * (log_p_t - log_p_s), axis=-1)
    return t_s ** 2 * kl / teacher.shape[-1]


def _mean_over_groups(terms: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, N] terms -> mean over each image's valid entries, then over images having any."""
    mask = mask.astype(bool)
    count = jnp.sum(mask, axis=1)
    per_image = jnp.sum(jnp.where(mask, terms, 0.0), axis=1) / jnp.maximum(count, 1)
    has = count > 0
    return jnp.sum(jnp.where(has, per_image, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def kd_one_teacher_many_students(teacher: jax.Array, students: jax.Array, mask: jax.Array,
                                 log_scale: jax.Array, teacher_temp: float = TEACHER_TEMPERATURE
                                 ) -> jax.Array:
    """Vision KD (global -> object, global -> relation): teacher [B, D] (EMA global image
    embedding), students [B, N, D] (crop / region embeddings), mask [B, N]. No gradient reaches
    the teacher."""
    terms = _kd_terms(teacher[:, None, :], students, log_scale, teacher_temp)
    return _mean_over_groups(terms, mask)


def kd_many_teachers_one_student(teachers: jax.Array, mask: jax.Array, student: jax.Array,
                                 log_scale: jax.Array, teacher_temp: float = TEACHER_TEMPERATURE
                                 ) -> jax.Array:
    """Text KD (object -> global, relation -> global): teachers [B, N, D] (EMA object / relation
    text embeddings), mask [B, N], student [B, D] (global action text embedding). No gradient
    reaches the teachers."""
    terms = _kd_terms(teachers, student[:, None, :], log_scale, teacher_temp)
    return _mean_over_groups(terms, mask)
