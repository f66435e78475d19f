"""The optimiser update and the EMA teacher in one elementwise pass (`config.perf.fused_update`).

`core.make_optimizer`'s optax chain (clip by global norm, then per group Adam, decoupled weight
decay and the learning rate) followed by `core.ema_update` is a sequence of tree maps over
every trainable leaf (430 at ViT-B/32 with the paper's freezing): XLA fuses a leaf's
elementwise work, but runs kernels per leaf. `update` ravels the trainable leaves of each dtype into one buffer per
quantity (gradients, parameters, teacher, Adam's two moments), leaf after leaf grouped by
optimiser group, updates the buffers in one elementwise expression whose per-element
coefficients are each group's learning rate and bias corrections and each leaf's weight decay,
and splits them back. Same numbers as the chain (tests/test_step_switches.py).

The optimiser state stays the optax chain's pytree, leaf for leaf (`group_states` reads each
group's Adam moments and counts out of it, `update` writes them back into it), so a run can turn
the switch on or off across a resume and checkpoints restore either way.

The equations, per element, at optimiser step t (1-based) of a leaf in group G with weight
decay w (written once, in `clipped`, `adamw` and `ema`):

- clipping by global norm c: g <- g if ||g|| < c, else g c / ||g||, with ||g|| over every
  trainable gradient (`optax.clip_by_global_norm`);
- Adam's moments: m <- (1 - b1) g + b1 m, v <- (1 - b2) g^2 + b2 v;
- bias correction: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t);
- AdamW, decoupled weight decay: p <- p - lr_G (m_hat / (sqrt(v_hat) + eps) + w p), lr_G the
  group's learning rate at its step count (`optax.adamw`);
- EMA teacher: T <- p while t <= the warm-up steps, else decay T + (1 - decay) p.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def clipped(g: jax.Array, norm: jax.Array, max_norm: float) -> jax.Array:
    """Clipping by global norm: `g` scaled by max_norm / norm where norm >= max_norm."""
    return jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def adamw(g, p, m, v, *, lr, bc1, bc2, weight_decay, b1: float, b2: float, eps: float):
    """AdamW with decoupled weight decay and Adam's bias correction, as `optax.adamw`
    computes it: (p, m, v) after one step. `lr` is the negated learning rate (the step
    direction), `bc1` / `bc2` the bias corrections 1 - b1^t / 1 - b2^t; any of them and
    `weight_decay` may be arrays of per-element values."""
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * jnp.square(g) + b2 * v
    step = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + weight_decay * p
    return p + lr * step, m, v


def ema(teacher, student, copy, decay: float):
    """The EMA teacher: a copy of the student where `copy` (the warm-up), else
    decay * teacher + (1 - decay) * student."""
    return jnp.where(copy, student, decay * teacher + (1 - decay) * student)


def group_states(opt_state) -> dict[str, tuple[optax.ScaleByAdamState, optax.ScaleByScheduleState]]:
    """Group -> (its Adam state, its learning-rate schedule's state) in the state of
    `core.make_optimizer`'s chain: (clip state, multi_transform state of masked chains that
    start with `scale_by_adam` and end with the schedule)."""
    out = {}
    for group, masked in opt_state[1].inner_states.items():
        adam, schedule = masked.inner_state[0], masked.inner_state[-1]
        if not isinstance(adam, optax.ScaleByAdamState) or \
                not isinstance(schedule, optax.ScaleByScheduleState):
            raise TypeError(f"optimiser group {group!r}: {type(masked.inner_state).__name__} is "
                            "not Adam followed by a learning-rate schedule")
        out[group] = adam, schedule
    return out


def _with_group_states(opt_state, new: dict):
    """`opt_state` with each group's (Adam state, schedule state) replaced by `new`'s."""
    partition = opt_state[1]
    inner = {group: masked._replace(inner_state=(new[group][0], *masked.inner_state[1:-1],
                                                 new[group][1]))
             for group, masked in partition.inner_states.items()}
    return (opt_state[0], partition._replace(inner_states=inner), *opt_state[2:])


class _Buffer(NamedTuple):
    """The leaves of one dtype as one flat buffer: `order` (leaf indices, in buffer order) and
    `runs` ((group, weight decay), elements) of consecutive leaves that share them."""
    order: list[int]
    runs: list[tuple[tuple[str, float], int]]


def _buffers(leaves: list, groups: list[str], decays: list[float]) -> list[_Buffer]:
    """A buffer per dtype of `leaves`, its leaves ordered by group and weight decay: each
    per-element coefficient is then a few constant runs."""
    out = []
    for dtype in sorted({x.dtype for x in leaves}, key=str):
        order = sorted((i for i, x in enumerate(leaves) if x.dtype == dtype),
                       key=lambda i: (groups[i], decays[i]))
        runs = []
        for i in order:
            key = (groups[i], decays[i])
            if runs and runs[-1][0] == key:
                runs[-1] = (key, runs[-1][1] + leaves[i].size)
            else:
                runs.append((key, leaves[i].size))
        out.append(_Buffer(order, runs))
    return out


def _pass(buffer: _Buffer, leaves: dict[str, list], coefficients: dict, norm, copy, cfg
          ) -> dict[str, list]:
    """The update of one buffer: name ("p", "t", "m", "v") -> its new leaves (by index)."""
    dtype = leaves["g"][buffer.order[0]].dtype

    def flat(name):
        return jnp.concatenate([leaves[name][i].reshape(-1) for i in buffer.order])

    def per_element(value):
        return jnp.concatenate([jnp.full((n,), value(key), dtype) for key, n in buffer.runs])

    p, m, v = adamw(clipped(flat("g"), norm, cfg.grad_clip), flat("p"), flat("m"), flat("v"),
                    b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=per_element(lambda key: key[1]),
                    **{name: per_element(lambda key, name=name: coefficients[key[0]][name])
                       for name in ("lr", "bc1", "bc2")})
    t = ema(flat("t"), p, copy, cfg.ema_decay)
    out = {}
    for name, flat_new in (("p", p), ("t", t), ("m", m), ("v", v)):
        out[name], at = {}, 0
        for i in buffer.order:
            shape = leaves["g"][i].shape
            out[name][i] = flat_new[at:at + leaves["g"][i].size].reshape(shape)
            at += leaves["g"][i].size
    return out


def update(grads: PyTree, opt_state, params: PyTree, teacher: PyTree, step: jax.Array, *,
           labels: PyTree, weight_decays: PyTree, learning_rates: Mapping[str, Callable], cfg
           ) -> tuple[PyTree, PyTree, Any]:
    """(params, teacher, opt_state) after optimiser step `step` (1-based): the numbers of
    `core.make_optimizer`'s chain followed by `core.ema_update`, in one pass.

    `grads`, `params`, `teacher`, `labels` (group names) and `weight_decays` (floats) share the
    trainable parameters' tree; `learning_rates` maps each group to its schedule; `cfg` (a
    `core.TrainConfig`) gives b1, b2, eps, grad_clip, ema_decay and ema_warmup_steps."""
    g, treedef = jax.tree.flatten(grads)
    groups, decays = treedef.flatten_up_to(labels), treedef.flatten_up_to(weight_decays)
    leaves = {"g": g, "p": treedef.flatten_up_to(params), "t": treedef.flatten_up_to(teacher),
              "m": [None] * len(g), "v": [None] * len(g)}
    states = group_states(opt_state)
    members = {group: [i for i, label in enumerate(groups) if label == group] for group in states}
    coefficients = {}
    for group, (adam, schedule) in states.items():
        for i, m, v in zip(members[group], jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu),
                           strict=True):
            leaves["m"][i], leaves["v"][i] = m, v
        count = optax.safe_increment(adam.count)
        coefficients[group] = dict(lr=-learning_rates[group](schedule.count),
                                   bc1=1 - cfg.b1 ** count, bc2=1 - cfg.b2 ** count)
    norm, copy = optax.global_norm(grads), step <= cfg.ema_warmup_steps
    new = {name: [None] * len(g) for name in "ptmv"}
    for buffer in _buffers(g, groups, decays):
        for name, part in _pass(buffer, leaves, coefficients, norm, copy, cfg).items():
            for i, x in part.items():
                new[name][i] = x

    def moments(tree, name, group):
        return jax.tree.unflatten(jax.tree.structure(tree), [new[name][i] for i in members[group]])

    new_states = {group: (adam._replace(count=optax.safe_increment(adam.count),
                                        mu=moments(adam.mu, "m", group),
                                        nu=moments(adam.nu, "v", group)),
                          schedule._replace(count=optax.safe_increment(schedule.count)))
                  for group, (adam, schedule) in states.items()}
    return (treedef.unflatten(new["p"]), treedef.unflatten(new["t"]),
            _with_group_states(opt_state, new_states))
