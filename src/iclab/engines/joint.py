"""The joint trainer: a grid of independent models ("members") trained together on shared minibatches.

Figures of these papers train many small models that differ in a setting (a forget factor λ, a
task correlation, a context length n̄, a depth) and are compared on the same data. Training them
one by one wastes the sampling, which is most of a step's cost, and compiles one loop per model.
:func:`train_members` trains every member of a grid in ONE loop, on the sum of the members' losses

    L(θ_1, …, θ_M) = Σ_m ℓ_m(θ_m; batch_k),   batch_k = sampler(fold_in(key_data, k), aux),

with one fresh batch per step shared by every member (common random numbers). Since ∂L/∂θ_m =
∂ℓ_m/∂θ_m, any optimiser that acts elementwise (GD, Adam, AdamW, with per-member gradient clipping,
``clip_norm``) moves each member exactly as if it were trained alone on the same batches. Seeds are
vmapped.

Members come in groups (:class:`Members`): the members of a group share a parameter structure and
are stacked along leading member axes (e.g. (panel, n̄)); different groups may differ in structure
(e.g. one group per model kind or depth). Keys depend only on (seed, member id, step):

- seed s: key_s = fold_in(PRNGKey(seed), s) (:func:`seed_keys`);
- member m's init: ``init(fold_in(fold_in(key_s, init_stream), id_m), setting_m)``;
- step k's batch: ``sampler(fold_in(fold_in(key_s, data_stream), k), aux)``.

so a subset of the members (a group with fewer ids and their settings) trained alone follows the
same trajectory, to float rounding, as inside the full grid, provided the sampler's batch does not
depend on which members train: the base for sharding a figure across machines.

:func:`train_family` is the one call for one registered model family on a task's sampler: it builds the group
(:func:`family_members`, the family's own target), initialises it and casts params and batches to one dtype
(float32 or float64), and trains it by :func:`train_members`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from iclab.engines._descent import Schedule, descend
from iclab.engines._loop import Trajectory
from iclab.errors import ConfigError
from iclab.models import ModelFamily, get_model
from iclab.progress import Reporter, task

__all__ = ["Members", "clip_by_member_norm", "each_member", "family_members", "group_losses", "init_members",
           "member_keys", "seed_keys", "train_family", "train_members"]


class Members(NamedTuple):
    """A group of members with one parameter structure, stacked along ``ids.ndim`` leading axes.

    Attributes:
        init: ``init(key, setting) -> params`` of ONE member (its key and its setting); may be None when
            :func:`train_members` gets the initial params (``params0``).
        loss: ``loss(params, batch, settings) -> losses``: the whole group at once, params and settings
            with the leading member axes, losses of shape ``ids.shape``; vectorise it as the data
            allows (:func:`each_member` vmaps a one-member loss over the member axes).
        ids: (*shape,) integers, the members' global indices in the grid (distinct across groups);
            they alone fix each member's init key.
        settings: a pytree with leading axes ``ids.shape`` (e.g. each member's λ), or None.
        joint: None, or a function computing the losses of several groups in one call (e.g. one kernel call for
            the grids of every depth): ``joint(params, batch, settings) -> losses``, each a dict over the groups
            whose ``joint`` is this same function (:func:`group_losses`); each group's ``loss`` gives the same
            values alone (a group trained without the others).
    """

    init: Callable[[jax.Array, Any], Any] | None
    loss: Callable[[Any, Any, Any], jax.Array]
    ids: np.ndarray
    settings: Any = None
    joint: Callable[[dict, Any, dict], dict] | None = None


def group_losses(groups: Mapping[str, Members], params: Mapping[str, Any], batch: Any,
                 settings: Mapping[str, Any]) -> dict:
    """Every group's member losses on one batch: name -> ``ids.shape`` losses; the groups sharing a ``joint``
    function in one call of it, the others by their ``loss``.

    Args:
        groups: name -> :class:`Members`.
        params, settings: name -> the group's params and settings (leading member axes).
        batch: the shared batch.
    Returns:
        name -> losses, in the order of ``groups``.
    """
    out = {}
    for name, g in groups.items():
        if name in out:
            continue
        if g.joint is None:
            out[name] = g.loss(params[name], batch, settings[name])
            continue
        names = [n for n, h in groups.items() if h.joint is g.joint]
        out.update(g.joint({n: params[n] for n in names}, batch, {n: settings[n] for n in names}))
    return {name: out[name] for name in groups}


def each_member(loss_one: Callable[[Any, Any, Any], jax.Array], ndim: int = 1) -> Callable:
    """A group loss from a one-member loss: ``loss_one(params, batch, setting) -> scalar`` vmapped over
    ``ndim`` leading member axes of params and settings; the batch is shared (not mapped).

    Args:
        loss_one: the loss of one member on the shared batch.
        ndim: number of leading member axes.
    Returns:
        ``loss(params, batch, settings) -> (*shape,)``.
    """
    fn = loss_one
    for _ in range(ndim):
        fn = jax.vmap(fn, in_axes=(0, None, 0))
    return fn


def family_members(family: ModelFamily | str, ids, *, sizes: Mapping[str, Any], settings: Mapping[str, Any] | None = None,
                   target: Callable[[Any], jax.Array] | None = None) -> Members:
    """A group of members of one registered model family, trained on the squared error of its prediction.

    Each member is ``family.init(key, **sizes)``; its loss on the shared batch (prompts of the family's task) is
    the mean squared query error (1/P) Σ_p (ŷ_p − y_p)², ŷ = ``family.predict(params, batch, **options)``, where
    the options are the member's own entries of ``settings`` (e.g. a softmax temperature ``rho`` per member; the
    family must name them in its ``options``). The members of a group share ``sizes`` (one parameter structure);
    a grid over sizes is one group per size.

    Args:
        family: a registered :class:`iclab.models.ModelFamily`, or its name.
        ids: (*shape,) member ids (distinct across the groups of a grid; they fix the init keys).
        sizes: the keywords of ``family.init`` besides the key (a linreg family: D, H, R, w_init; others as they
            document).
        settings: {option: (*shape,) values} of ``family.predict``'s options, one per member (None: none).
        target: ``batch -> (P,)`` targets (default: the family's ``target``, else ``batch.y_q``).
    Returns:
        :class:`Members` for :func:`train_members`.
    """
    family = get_model(family) if isinstance(family, str) else family
    ids = np.asarray(ids)
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(family.options))
    if unknown:
        raise ValueError(f"settings {unknown} are not options of model family {family.name!r} "
                         f"(its options: {', '.join(family.options) or 'none'})")
    for name, value in settings.items():
        if np.shape(value)[:ids.ndim] != ids.shape:
            raise ValueError(f"settings[{name!r}] must have the members' shape {ids.shape} in front "
                             f"(got {np.shape(value)})")
    sizes = dict(sizes)
    targets = target or family.target or (lambda batch: batch.y_q)

    def init(key, setting):
        return family.init(key, **sizes)

    def loss_one(params, batch, setting):
        return jnp.mean((family.predict(params, batch, **(setting or {})) - targets(batch)) ** 2)

    group_settings = {k: jnp.asarray(v) for k, v in settings.items()} or None
    return Members(init, each_member(loss_one, ids.ndim), ids, group_settings)


def seed_keys(seed: int, seeds: int) -> jax.Array:
    """One key per seed: key_s = fold_in(PRNGKey(seed), s), s = 0..seeds−1.

    Args:
        seed: the base seed of a run.
        seeds: number of seeds.
    Returns:
        (seeds, 2) uint32 keys.
    """
    base = jax.random.PRNGKey(seed)
    return jnp.stack([jax.random.fold_in(base, s) for s in range(seeds)])


def member_keys(key: jax.Array, ids, stream: int) -> jax.Array:
    """Init keys of members: fold_in(fold_in(key, stream), id) for each id.

    Args:
        key: (2,) one seed's key.
        ids: (*shape,) member ids.
        stream: the init stream (separates init from data and evaluation keys).
    Returns:
        (*shape, 2) keys.
    """
    ids = jnp.asarray(ids)
    base = jax.random.fold_in(key, stream)
    flat = jax.vmap(lambda i: jax.random.fold_in(base, i))(ids.reshape(-1))
    return flat.reshape(ids.shape + flat.shape[1:])


def init_members(group: Members, keys: jax.Array, stream: int = 1):
    """Initial params of a group for every seed.

    Args:
        group: the members.
        keys: (S, 2) seed keys.
        stream: the init stream of :func:`member_keys`.
    Returns:
        params with leading (S, *shape) axes.
    """
    ids = np.asarray(group.ids)
    shape = ids.shape

    def one_seed(key):
        mk = member_keys(key, ids, stream).reshape((-1, 2))
        settings = None if group.settings is None else jax.tree_util.tree_map(
            lambda a: jnp.reshape(a, (-1,) + jnp.shape(a)[len(shape):]), group.settings)
        flat = jax.vmap(group.init)(mk, settings)
        return jax.tree_util.tree_map(lambda a: a.reshape(shape + a.shape[1:]), flat)

    # One compiled init: it runs once, so LLVM optimisation is skipped (it costs seconds of compile time).
    return jax.jit(jax.vmap(one_seed), compiler_options={"xla_backend_optimization_level": 0})(keys)


def clip_by_member_norm(max_norm: float, member_ndim: Mapping[str, int]) -> optax.GradientTransformation:
    """Scales each member's update to Euclidean norm ≤ max_norm, every member by its own norm.

    The updates are a dict group -> pytree whose leaves carry ``member_ndim[group]`` leading member axes
    (after any seed axis, which vmap removes). Equal to ``optax.clip_by_global_norm(max_norm)`` applied
    to each member alone: one global norm over the grid would couple the members.

    Args:
        max_norm: > 0.
        member_ndim: group name -> number of leading member axes.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_norm must be > 0 (got {max_norm})")

    def clip(tree, lead):
        leaves = jax.tree_util.tree_leaves(tree)
        sq = sum(jnp.sum(g.reshape(g.shape[:lead] + (-1,)) ** 2, axis=-1) for g in leaves)
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(jnp.sqrt(sq), 1e-30))
        return jax.tree_util.tree_map(
            lambda g: g * factor.reshape(factor.shape + (1,) * (g.ndim - lead)).astype(g.dtype), tree)

    def update(updates, state, params=None):
        return {name: clip(tree, member_ndim[name]) for name, tree in updates.items()}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def train_members(
    groups: Mapping[str, Members],
    sampler: Callable[[jax.Array, Any], Any],
    *,
    keys: jax.Array,
    lr: Schedule,
    n_steps: int,
    optimizer: optax.GradientTransformation | None = None,
    clip_norm: float | None = None,
    record_every: int = 1,
    aux: Any = None,
    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
    record_member_loss: bool = True,
    record_params: bool = False,
    params0: Mapping[str, Any] | None = None,
    init_stream: int = 1,
    data_stream: int = 2,
    reporter: Reporter | None = None,
    label: str = "train",
) -> Trajectory:
    """Trains every member of every group jointly on shared minibatches, every seed at once (module docstring).

    Args:
        groups: name -> :class:`Members`.
        sampler: ``sampler(key, aux) -> batch``, one fresh batch per step shared by every member.
        keys: (S, 2) seed keys (:func:`seed_keys`).
        lr: a float or a schedule step -> lr; t = Σ lr.
        n_steps: optimiser steps.
        optimizer: the update direction, an optax GradientTransformation without learning rate
            (None: plain GD; ``optax.scale_by_adam()``: Adam); see :mod:`iclab.engines._descent`.
        clip_norm: clip each member's gradient to this norm before the optimizer (None: no clipping).
        record_every: record spacing in steps.
        aux: constants of the run, per seed (leading S axis), passed to the sampler and the metrics.
        metrics: {name: fn(params, aux)} recorded beside the loss (params: dict group -> one seed's params).
        record_member_loss: record each member's loss as metric ``member_loss`` (dict group -> (S, T, *shape)).
        record_params: record the params at every record (leading (S, T) axes).
        params0: initial params per group (leading (S, *shape) axes) instead of each group's ``init``
            (e.g. a theory init that needs no key); the keys then fix the data only.
        init_stream, data_stream: the fold_in streams of the init and data keys.
        reporter: progress reporter (None: silent); the loop is one task named ``label``.
    Returns:
        A Trajectory: ``loss`` (S, T) is the summed loss Σ_m ℓ_m of the batch the next step uses;
        ``final_params`` the params after the last step (dict group -> (S, *shape, ...)).
    """
    if not groups:
        raise ValueError("train_members needs at least one group of members")
    all_ids = np.concatenate([np.asarray(g.ids).reshape(-1) for g in groups.values()])
    if np.unique(all_ids).size != all_ids.size:
        raise ValueError("member ids must be distinct across the groups of a grid")
    keys = jnp.asarray(keys)
    if params0 is None:
        missing = [name for name, g in groups.items() if g.init is None]
        if missing:
            raise ValueError(f"groups {missing} have no init: give params0")
        params0 = {name: init_members(g, keys, init_stream) for name, g in groups.items()}
    settings = {name: g.settings for name, g in groups.items()}

    def member_losses(params, state):
        batch = sampler(jax.random.fold_in(state.key, state.step), state.aux)
        return group_losses(groups, params, batch, settings)

    def total(losses):
        return sum(jnp.sum(v) for v in losses.values())

    def objective(params, state):
        return total(member_losses(params, state))

    def observation(params, state):  # the loss of the batch the next step uses, and each member's share
        losses = member_losses(params, state)
        return total(losses), {"member_loss": losses}

    if clip_norm:
        ndim = {name: np.asarray(g.ids).ndim for name, g in groups.items()}
        optimizer = optax.chain(clip_by_member_norm(clip_norm, ndim), optimizer or optax.identity())
    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, data_stream))(keys)
    with task(reporter, label, n_steps) as cb:
        return descend(objective, params0, aux, lr=lr, n_steps=n_steps, optimizer=optimizer, key=data_keys,
                       record_every=record_every, metrics=dict(metrics or {}), record_params=record_params,
                       batched=True, callback=cb, observation=observation if record_member_loss else None)


def _cast_floats(tree, dtype):
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)


def train_family(
    family: ModelFamily | str,
    sampler: Callable[[jax.Array, Any], Any],
    *,
    sizes: Mapping[str, Any],
    lr: Schedule,
    steps: int,
    seeds: int = 1,
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
    settings: Mapping[str, Any] | None = None,
    dtype=jnp.float64,
    clip_norm: float | None = None,
    record_every: int = 1,
    aux: Any = None,
    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
    record_params: bool = False,
    target: Callable[[Any], jax.Array] | None = None,
    reporter: Reporter | None = None,
) -> Trajectory:
    """Trains one registered model family on a task's sampler: M members (M = 1, or one per entry of ``settings``)
    and ``seeds`` seeds, each on the mean squared error of its prediction, one fresh shared batch per step.

    The members are ``family_members(family, arange(M), sizes=sizes, settings=settings, target=target)``; their
    params (``init_members`` at key_s = fold_in(PRNGKey(seed), s)) and every floating leaf of each batch are cast
    to ``dtype``, and :func:`train_members` trains them under the group name ``family.name``.

    Args:
        family: a registered :class:`iclab.models.ModelFamily`, or its name.
        sampler: ``sampler(key, aux) -> batch`` of prompts of the family's task (e.g.
            ``lambda key, aux: linreg.sample_prompts(key, Lam, N, P)``).
        sizes: the keywords of ``family.init`` besides the key.
        lr: a float or a schedule step -> lr; t = Σ lr.
        steps: optimiser steps (≥ 1).
        seeds: independent seeds S (≥ 1), vmapped; seed: the base seed.
        optimizer: the update direction without learning rate (None: plain GD; ``optax.scale_by_adam()``: Adam).
        settings: {option: (M,) values} of ``family.predict``'s options, one per member (None: one member).
        dtype: the params' and the batches' float dtype (``jnp.float32`` or ``jnp.float64``).
        clip_norm, record_every, aux, metrics, record_params, reporter: as :func:`train_members`.
        target: ``batch -> targets`` (None: the family's own).
    Raises:
        ConfigError: steps or seeds not a positive integer, or a dtype other than float32 and float64 (one line).
    Returns:
        The Trajectory of :func:`train_members`: ``loss`` (S, T) the members' summed loss of the batch the next step
        uses, ``metrics["member_loss"][family.name]`` (S, T, M) each member's, ``final_params[family.name]`` with
        leading (S, M) axes.
    """
    family = get_model(family) if isinstance(family, str) else family
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ConfigError(f"train_family: steps must be an integer ≥ 1 (got {steps!r})")
    if not isinstance(seeds, (int, np.integer)) or seeds < 1:
        raise ConfigError(f"train_family: seeds must be an integer ≥ 1 (got {seeds!r})")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ConfigError(f"train_family: dtype must be float32 or float64 (got {jnp.dtype(dtype).name})")
    members = len(np.asarray(next(iter(settings.values())))) if settings else 1
    group = family_members(family, np.arange(members), sizes=sizes, settings=settings, target=target)
    keys = seed_keys(seed, seeds)
    params0 = {family.name: _cast_floats(init_members(group, keys), dtype)}

    def cast_sampler(key, aux):
        return _cast_floats(sampler(key, aux), dtype)

    return train_members({family.name: group}, cast_sampler, keys=keys, lr=lr, n_steps=int(steps),
                         optimizer=optimizer, clip_norm=clip_norm, record_every=record_every, aux=aux, metrics=metrics,
                         record_params=record_params, params0=params0, reporter=reporter, label=family.name)
