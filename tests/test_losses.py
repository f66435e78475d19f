"""sclaro_jax.losses against the reference semantics written in PyTorch / numpy, loop by loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sclaro_jax import losses


def _torch_clip(img, txt, logit_scale, mask):
    img, txt = torch.from_numpy(img[mask]), torch.from_numpy(txt[mask])
    scale = min(float(np.exp(logit_scale)), 100.0)
    logits = scale * F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T
    y = torch.arange(len(img))
    return float(0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y)))


@pytest.mark.parametrize("logit_scale", [np.log(1 / 0.07), 5.0])  # 5.0: exp > 100, clamped
def test_clip_contrastive_matches_torch(logit_scale):
    rng = np.random.default_rng(0)
    img = rng.normal(size=(12, 16)).astype(np.float32)
    txt = rng.normal(size=(12, 16)).astype(np.float32)
    mask = rng.uniform(size=12) < 0.7
    got = losses.clip_contrastive(img, txt, jnp.float32(logit_scale), jnp.asarray(mask))
    np.testing.assert_allclose(float(got), _torch_clip(img, txt, logit_scale, mask), rtol=1e-5)
    full = losses.clip_contrastive(img, txt, jnp.float32(logit_scale))
    np.testing.assert_allclose(float(full), _torch_clip(img, txt, logit_scale, np.ones(12, bool)),
                               rtol=1e-5)
    assert float(losses.clip_contrastive(img, txt, jnp.float32(1.0), jnp.zeros(12, bool))) == 0.0


def test_clip_contrastive_duplicate_aware_labels():
    rng = np.random.default_rng(1)
    img = rng.normal(size=(6, 8)).astype(np.float32)
    txt = rng.normal(size=(6, 8)).astype(np.float32)
    labels = np.array([0, 1, 0, 2, 1, 3])
    s = 3.0
    a = img / np.linalg.norm(img, axis=1, keepdims=True)
    b = txt / np.linalg.norm(txt, axis=1, keepdims=True)
    logits = np.exp(s) * a @ b.T
    total = 0.0
    for i in range(6):  # plain loops: leave out same-label candidates other than the pair
        keep = [j for j in range(6) if labels[j] != labels[i] or j == i]
        row, col = logits[i, keep], logits[keep, i]
        pos = keep.index(i)
        total += 0.5 * (-(row[pos] - np.log(np.exp(row).sum()))
                        - (col[pos] - np.log(np.exp(col).sum())))
    got = losses.clip_contrastive(img, txt, jnp.float32(s), labels=jnp.asarray(labels))
    np.testing.assert_allclose(float(got), total / 6, rtol=1e-5)


def _torch_kd_pair(teacher_vec, student_vec, log_scale, t_t=0.07, floor=1e-8):
    """The reference: the teacher's softmax clamped to [1e-8, 1], KLDivLoss(batchmean) on one
    1-D embedding pair, times T_s^2 (`floor=None`: no clamp, Eq. 8 as written)."""
    t_s = 1.0 / float(np.clip(np.exp(log_scale), 1, 100))
    log_p_s = F.log_softmax(torch.from_numpy(student_vec) / t_s, dim=-1)
    p_t = F.softmax(torch.from_numpy(teacher_vec) / t_t, dim=-1)
    if floor is not None:
        p_t = p_t.clamp(min=floor, max=1.0)
    return float(F.kl_div(log_p_s, p_t, reduction="batchmean")) * t_s ** 2


def _kd_inputs(seed=0, b=5, n=4, d=32):
    rng = np.random.default_rng(seed)
    single = rng.normal(size=(b, d)).astype(np.float32)
    group = rng.normal(size=(b, n, d)).astype(np.float32)
    mask = rng.uniform(size=(b, n)) < 0.6
    mask[1] = False  # an image with no objects: left out of the mean over images
    mask[2, 0] = True
    return single, group, mask


def _reference_vision_kd(teacher, students, mask, log_scale):
    """The reference's per-image Python loop over `_torch_kd_pair` (vision KD: one teacher,
    many students): the mean over each image's valid crops, then over the images with any."""
    per_image = []
    for b in range(len(teacher)):
        terms = [_torch_kd_pair(teacher[b], students[b, n], log_scale)
                 for n in range(students.shape[1]) if mask[b, n]]
        if terms:
            per_image.append(np.mean(terms))
    return np.mean(per_image)


@pytest.mark.parametrize("log_scale", [np.log(1 / 0.07), 0.3, -1.0])
def test_kd_one_teacher_many_students_matches_reference_loops(log_scale):
    teacher, students, mask = _kd_inputs()
    got = losses.kd_one_teacher_many_students(teacher, students, jnp.asarray(mask),
                                              jnp.float32(log_scale))
    np.testing.assert_allclose(float(got), _reference_vision_kd(teacher, students, mask,
                                                                log_scale), rtol=1e-5)


def test_kd_many_teachers_one_student_matches_reference_loops():
    student, teachers, mask = _kd_inputs(seed=1)
    log_scale = np.log(1 / 0.07)
    per_image = []
    for b in range(len(student)):
        terms = [_torch_kd_pair(teachers[b, n], student[b], log_scale)
                 for n in range(teachers.shape[1]) if mask[b, n]]
        if terms:
            per_image.append(np.mean(terms))
    got = losses.kd_many_teachers_one_student(teachers, jnp.asarray(mask), student,
                                              jnp.float32(log_scale))
    np.testing.assert_allclose(float(got), np.mean(per_image), rtol=1e-5)


def test_no_gradient_reaches_teachers_and_the_temperature_learns():
    single, group, mask = _kd_inputs(seed=2)
    mask = jnp.asarray(mask)
    l0 = jnp.float32(np.log(1 / 0.07))
    g_t, g_s, g_l = jax.grad(losses.kd_one_teacher_many_students, argnums=(0, 1, 3))(
        single, group, mask, l0)
    assert not np.asarray(g_t).any()
    assert np.abs(np.asarray(g_s)).sum() > 0 and float(g_l) != 0.0
    assert not np.asarray(g_s)[~np.asarray(mask)].any()  # padding gets no gradient
    g_t, g_s, g_l = jax.grad(losses.kd_many_teachers_one_student, argnums=(0, 2, 3))(
        group, mask, single, l0)
    assert not np.asarray(g_t).any()
    assert np.abs(np.asarray(g_s)).sum() > 0 and float(g_l) != 0.0
    # clamped at exp(l) = 100: the temperature no longer moves
    assert float(jax.grad(losses.kd_many_teachers_one_student, argnums=3)(
        group, mask, single, jnp.float32(5.0))) == 0.0


@pytest.mark.parametrize("log_scale", [np.log(1 / 0.07), 1.0])
def test_the_kd_temperatures_gradient_is_the_numpy_losss_slope(log_scale):
    """The gradient that trains the KD temperature (d loss / d log_scale) has the sign and size
    of the slope of the reference's loss in float64 (central difference): a step against it
    lowers the loss."""
    single, group, mask = _kd_inputs(seed=4)
    got = float(jax.grad(losses.kd_one_teacher_many_students, argnums=3)(
        single, group, jnp.asarray(mask), jnp.float32(log_scale)))
    h = 1e-4
    teacher, students = single.astype(np.float64), group.astype(np.float64)
    slope = (_reference_vision_kd(teacher, students, mask, log_scale + h)
             - _reference_vision_kd(teacher, students, mask, log_scale - h)) / (2 * h)
    assert abs(slope) > 1e-3  # a slope whose sign can be told
    assert got == pytest.approx(slope, rel=1e-3)


def test_losses_are_float32_for_bf16_inputs():
    single, group, mask = _kd_inputs(seed=3)
    bf = losses.kd_one_teacher_many_students(jnp.asarray(single, jnp.bfloat16),
                                             jnp.asarray(group, jnp.bfloat16), jnp.asarray(mask),
                                             jnp.float32(2.0))
    assert bf.dtype == jnp.float32
    c = losses.clip_contrastive(jnp.asarray(single, jnp.bfloat16),
                                jnp.asarray(single, jnp.bfloat16), jnp.float32(2.0))
    assert c.dtype == jnp.float32


def test_kd_term_is_eq8_for_one_pair():
    """The default clamps the teacher's probabilities at 1e-8 as the reference does;
    `teacher_floor=0` is Eq. 8 as written."""
    rng = np.random.default_rng(4)
    t, s = rng.normal(size=(2, 24)).astype(np.float32)
    for log_scale in (np.log(1 / 0.07), 0.5):
        for floor in (1e-8, None):
            got = losses.kd_term(t, s, jnp.float32(log_scale), teacher_floor=floor or 0.0)
            np.testing.assert_allclose(float(got), _torch_kd_pair(t, s, log_scale, floor=floor),
                                       rtol=1e-5)
        np.testing.assert_allclose(float(losses.kd_term(t, s, jnp.float32(log_scale))),
                                   _torch_kd_pair(t, s, log_scale), rtol=1e-5)
    # where the student agrees with the teacher on its likely features and is far below it on
    # the rest, the floor's terms 1e-8 (log 1e-8 - log p_s) are all of the loss
    t = np.array([1.0, 0.5, 0.0] + [-3.0] * 5, np.float32)
    s = np.array([1.0, 0.5, 0.0] + [-300.0] * 5, np.float32)
    l0 = jnp.float32(np.log(1 / 0.07))
    got = float(losses.kd_term(t, s, l0))
    # (float32 rounding of the first three features' near-zero terms: 1e-4 of this small loss)
    np.testing.assert_allclose(got, _torch_kd_pair(t, s, np.log(1 / 0.07)), rtol=1e-3)
    assert got > 1e-7 and abs(float(losses.kd_term(t, s, l0, teacher_floor=0.0))) < 1e-3 * got


def _total_inputs(seed=5, b=4, n=3, d=8):
    rng = np.random.default_rng(seed)
    emb = {"global": (rng.normal(size=(b, d)), rng.normal(size=(b, d)))}
    for level in ("object", "relation"):
        emb[level] = (rng.normal(size=(b, n, d)), rng.normal(size=(b, n, d)))
    emb = {k: tuple(jnp.asarray(x, jnp.float32) for x in v) for k, v in emb.items()}
    masks = {"global": jnp.asarray([True, False, True, True]),
             "object": jnp.asarray(rng.uniform(size=(b, n)) < 0.7),
             "relation": jnp.asarray(rng.uniform(size=(b, n)) < 0.7)}
    scales = {"global": jnp.float32(2.0), "object": jnp.float32(2.5), "relation": jnp.float32(3.0)}
    teacher_image = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    teacher_texts = {k: jnp.asarray(rng.normal(size=(b, n, d)), jnp.float32)
                     for k in ("object", "relation")}
    return emb, masks, scales, teacher_image, teacher_texts


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["both", "vision", "text"])
def test_scenarioclip_total_combines_the_named_terms(direction):
    emb, masks, scales, t_img, t_txt = _total_inputs()
    log_kd = jnp.float32(2.2)
    total, m = losses.scenarioclip_total(emb, masks, scales, lambda_ca=0.5, lambda_kd=2.0,
                                         kd_log_scale=log_kd, teacher_image=t_img,
                                         teacher_texts=t_txt, kd_direction=direction)
    ca = [losses.clip_contrastive(emb[k][0].reshape(-1, 8), emb[k][1].reshape(-1, 8), scales[k],
                                  masks[k].reshape(-1)) for k in ("global", "object", "relation")]
    kd = 0.0
    for k in ("object", "relation"):
        if direction != "text":
            kd += float(losses.kd_one_teacher_many_students(t_img, emb[k][0], masks[k], log_kd))
        if direction != "vision":  # image 1 has no action: out of the text terms
            kd += float(losses.kd_many_teachers_one_student(
                t_txt[k], masks[k] & masks["global"][:, None], emb["global"][1], log_kd))
    np.testing.assert_allclose(float(m["loss_ca"]), sum(map(float, ca)), rtol=1e-6)
    np.testing.assert_allclose(float(m["loss_kd"]), kd, rtol=1e-6)
    np.testing.assert_allclose(float(total), 0.5 * sum(map(float, ca)) + 2.0 * kd, rtol=1e-6)
    np.testing.assert_allclose(float(m["kd_temperature"]), np.exp(-2.2), rtol=1e-6)
    np.testing.assert_allclose(float(m["logit_scale_relation"]), np.exp(3.0), rtol=1e-6)


def test_scenarioclip_total_without_kd_and_with_labels():
    emb, masks, scales, _, _ = _total_inputs(seed=6)
    labels = {k: jnp.zeros((4, 3), jnp.int32) for k in ("object", "relation")}
    total, m = losses.scenarioclip_total(emb, masks, scales, labels=labels)
    assert float(m["loss_kd"]) == 0.0 and "kd_temperature" not in m
    # every crop shares one label: only the positive pair is left in each softmax
    assert float(m["loss_object"]) == pytest.approx(0.0, abs=1e-6)
    assert float(total) == pytest.approx(float(m["loss_global"]), rel=1e-6)
    with pytest.raises(ValueError, match="kd_direction"):
        losses.scenarioclip_total(emb, masks, scales, kd_direction="sideways")
