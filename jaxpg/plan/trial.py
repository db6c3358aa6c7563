"""Trials: run a layout's real training step on this machine's devices, and time it.

As Paddle's auto-tuner follows its memory model with real trials, :func:`trial_step` builds
the transformer of a :class:`~jaxpg.plan.TransformerSpec` (its attention with the spec's
heads, its MLP, a tied or separate output head, a cross-entropy loss) and one training step
under the layout, compiled by XLA over a ``(dp, ep, tp)`` mesh of the local devices (the
batch split over ``dp x ep``):

* ``tp``: Megatron's plan, q/k/v and the MLP's first matrices split by columns, the output
  projections by rows;
* ``dp_replicate x dp_shard``: the batch split over ``dp``; ZeRO-3 also splits every tensor
  over ``dp`` and gathers each where it is used, in every microbatch, as FSDP does (a
  sharding constraint: left to itself, XLA would rather gather the activations and keep
  the weights split), ZeRO-1/2 split the Adam state;
* ``microbatches``: gradient accumulation in a ``lax.scan``;
* ``remat``: ``jax.checkpoint`` around each block (``selective``, Korthikanti et al.'s: all
  kept but attention's core, the scores and their softmax, which the backward recomputes);
* ``ep`` (a MoE spec): each MoE block's MLP is :func:`jaxpg.expert_parallel.moe` (the router,
  dropless dispatch by ``all_to_all``, the experts' grouped matmul) over the ``ep`` group of
  a jaxpg mesh (:func:`jaxpg.init_device_mesh`, so the process group is initialised if it
  is not), inside a ``shard_map`` over ``dp x ep``; the routed experts are split over
  ``ep`` and, under ZeRO, over ``dp`` as well (what is left of the data-parallel ranks
  after ``ep``). The load-balancing loss is not added to the loss.

Pipelines and context parallelism are not tried here, nor tensor parallelism with experts
(:func:`trial_step` says so).
:func:`trial_times` times each step by wall clock and by the process's CPU time (the local
devices are threads of this process: CPU time counts their work and not the other programs
the machine runs), and reads the compiled step's per-device memory from XLA
(:class:`CompiledMemory`, from ``memory_analysis()``); :func:`trial_step` returns one figure.
:func:`compile_trial` keeps a compiled step (:class:`Trial`) so that several layouts can be
timed in turns.
The planner's prediction for the same layout is :func:`jaxpg.plan.evaluate`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from jaxpg.plan.job import Job
from jaxpg.plan.layout import Layout

__all__ = ["CompiledMemory", "Trial", "TrialTimes", "compile_trial", "trial_memory", "trial_step",
           "trial_times"]


def _init(spec, key, dtype):
    import jax
    import jax.numpy as jnp

    d, q, kv, f = spec.dim, spec.q_dim, spec.kv_dim, spec.ffn
    keys = iter(jax.random.split(key, 8 * spec.layers + 2))
    w = lambda *shape: (jax.random.normal(next(keys), shape, dtype)  # noqa: E731
                        / jnp.sqrt(shape[-2]).astype(dtype))
    blocks = []
    for i in range(spec.layers):
        if _is_moe_block(spec, i):
            e, fe = spec.experts, spec.expert_ffn
            gated = 2 if spec.mlp == "swiglu" else 1  # SwiGLU's [gate | up] in one matrix
            mlp = {"router": w(d, e), "w1": w(e, d, gated * fe), "w2": w(e, fe, d)}
        else:
            mlp = {"up": w(d, f), "down": w(f, d)}
            if spec.mlp == "swiglu":
                mlp["gate"] = w(d, f)
        blocks.append({"q": w(d, q), "k": w(d, kv), "v": w(d, kv), "o": w(q, d),
                       "ln1": jnp.ones((d,), dtype), "ln2": jnp.ones((d,), dtype), **mlp})
    params = {"embed": w(spec.vocab, d), "blocks": blocks, "ln_f": jnp.ones((d,), dtype)}
    if not spec.tied_embeddings:
        params["head"] = w(d, spec.vocab)
    return params


_BATCH = ("dp", "ep")  # the mesh axes the batch is split over
_EXPERTS = {"w1", "w2"}  # a MoE block's routed experts


def _is_moe_block(spec, i: int) -> bool:
    """Whether block ``i`` has a MoE MLP (the first ``dense_layers`` blocks are dense)."""
    return spec.is_moe and i >= spec.dense_layers


def _specs(params, layout: Layout):
    """PartitionSpecs: tp's Megatron plan, the routed experts split over ep, and ZeRO-3's
    split of each matrix over the data-parallel ranks (the experts' over what ep leaves)."""
    import jax
    from jax.sharding import PartitionSpec as P

    dp = _BATCH if layout.zero >= 3 else None
    column = {"q", "k", "v", "up", "gate", "head", "router"}

    def spec(path, leaf):
        name = getattr(path[-1], "key", None)
        if name in _EXPERTS:
            return P("ep", "dp" if layout.zero >= 3 else None, None)
        if leaf.ndim == 1:
            return P()
        if name == "embed":
            return P("tp", dp)
        if name in column:
            return P(dp, "tp")
        return P("tp", dp)

    return jax.tree_util.tree_map_with_path(spec, params)


def _rms(x, g):
    import jax.numpy as jnp

    return x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * g


_CORE = "attention_core"  # what selective recomputation recomputes


def _expert_mlp(spec, p, h, moe_call):
    """A MoE block's MLP: :func:`jaxpg.expert_parallel.moe` on the block's tokens."""
    b, s, d = h.shape
    y = moe_call(h.reshape(b * s, d), p["router"], p["w1"], p["w2"])
    return y.reshape(b, s, d)


def _block(spec, p, x, moe_call=None):
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    b, s, _ = x.shape
    hd = spec.head_dim
    h = _rms(x, p["ln1"])
    q = (h @ p["q"]).reshape(b, s, spec.heads, hd)
    k = (h @ p["k"]).reshape(b, s, spec.kv_heads, hd)
    v = (h @ p["v"]).reshape(b, s, spec.kv_heads, hd)
    group = spec.heads // spec.kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))
    scores = checkpoint_name(jnp.where(mask, scores, -1e9), _CORE)
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1), _CORE)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1) @ p["o"]
    h = _rms(x, p["ln2"])
    if "router" in p:
        return x + _expert_mlp(spec, p, h, moe_call)
    if spec.mlp == "swiglu":
        inner = jax.nn.silu(h @ p["gate"]) * (h @ p["up"])
    else:
        inner = jax.nn.gelu(h @ p["up"])
    return x + inner @ p["down"]


def _loss(spec, remat, params, tokens, gather=lambda p: p, moe_call=None):
    import jax
    import jax.numpy as jnp

    block = lambda p, x: _block(spec, gather(p), x, moe_call)  # noqa: E731
    if remat == "full":
        block = jax.checkpoint(block)
    elif remat == "selective":
        block = jax.checkpoint(
            block, policy=jax.checkpoint_policies.save_anything_except_these_names(_CORE))
    top = gather({k: v for k, v in params.items() if k != "blocks"})
    x = top["embed"][tokens[:, :-1]]
    for p in params["blocks"]:
        x = block(p, x)
    x = _rms(x, top["ln_f"])
    head = top["embed"].T if spec.tied_embeddings else top["head"]
    logits = (x @ head).astype(jnp.float32)
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _check_figure(caller: str, clock: str, statistic: str) -> None:
    """Refuses a clock other than ``"cpu"``/``"wall"`` or a statistic other than
    ``"min"``/``"median"``, naming ``caller``."""
    if clock not in ("cpu", "wall"):
        raise ValueError(f"{caller}: clock={clock!r} must be 'cpu' or 'wall'.")
    if statistic not in ("median", "min"):
        raise ValueError(f"{caller}: statistic={statistic!r} must be 'median' or 'min'.")


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """A compiled step's memory on one device, in bytes, as XLA's ``memory_analysis()``
    gives it.

    Attributes:
        arguments: the step's inputs on the device (parameters, Adam moments, tokens).
        outputs: its outputs (the new parameters and moments).
        aliased: the outputs written in place of donated inputs.
        temporaries: the program's working buffers (activations, gradients, gathered
            parameters, collectives' buffers).
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        """Inputs, outputs not written in place, and temporaries: the device's peak."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled) -> CompiledMemory:
        """Reads a ``jax.stages.Compiled``'s ``memory_analysis()``."""
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                   int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class TrialTimes:
    """The timed steps of one trial, by two clocks.

    Attributes:
        wall: each step's wall-clock seconds.
        cpu: each step's CPU seconds of this process, all its threads together. The local
            devices run in this process, so this is their work, whatever else the machine
            runs; wall time also holds the waits for cores other work took.
        memory: the compiled step's memory on one device.
    """

    wall: tuple[float, ...]
    cpu: tuple[float, ...]
    memory: CompiledMemory | None = None

    def seconds(self, clock: str = "cpu", statistic: str = "min") -> float:
        """One figure: ``clock`` ``"cpu"`` or ``"wall"``, ``statistic`` ``"min"`` or
        ``"median"``."""
        _check_figure("TrialTimes", clock, statistic)
        samples = self.cpu if clock == "cpu" else self.wall
        return statistics.median(samples) if statistic == "median" else min(samples)


def _mesh(layout: Layout, devices, moe: bool):
    """The ``(dp, ep, tp)`` mesh, and the expert-parallel group a MoE block runs over.

    A MoE's mesh is a jaxpg one (:func:`jaxpg.init_device_mesh`), its ``ep`` axis a
    process group; with ``ep = 1`` each rank runs every expert on its own tokens.
    """
    import numpy as np
    from jax.sharding import Mesh

    shape = (layout.dp // layout.ep, layout.ep, layout.tp)
    if not moe:
        return Mesh(np.array(devices).reshape(shape), ("dp", "ep", "tp")), None
    from jaxpg.groups import world
    from jaxpg.groups.device_mesh import init_device_mesh
    from jaxpg.groups.subgroups import new_subgroups

    if not world.is_initialized():
        world.init_process_group()
    if layout.ep == 1:
        one, _ = new_subgroups(group_size=1)
        return Mesh(np.array(devices).reshape(shape), ("dp", "ep", "tp")), one
    mesh = init_device_mesh(shape, ("dp", "ep", "tp"))
    if list(mesh.jax_mesh.devices.flat) != list(devices):
        raise ValueError(f"trial_step: a MoE layout with ep={layout.ep} runs on the world's "
                         f"devices in rank order; {len(devices)} others were given.")
    return mesh.jax_mesh, mesh["ep"]


def _build(job: Job, layout: Layout, devices, seed: int):
    """The compiled step and its first arguments (parameters, Adam moments, tokens)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpg.expert_parallel import moe

    spec, dt = job.model, {"bf16": jnp.bfloat16, "fp32": jnp.float32,
                           "fp16": jnp.float16}[job.dtype]
    mesh, ep_group = _mesh(layout, devices, spec.is_moe)
    params = _init(spec, jax.random.key(seed), dt)
    pspecs = _specs(params, layout)
    shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs)  # noqa: E731
    opt_specs = pspecs if layout.zero == 0 else _specs(params, layout.replace(zero=3))
    params = jax.device_put(params, shard(pspecs))
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
    opt = jax.device_put((zeros(), zeros()), shard((opt_specs, opt_specs)))
    m = layout.microbatches
    per = job.global_batch // m
    tokens = jax.random.randint(jax.random.key(seed + 1), (m, per, job.seq_len + 1), 0,
                                spec.vocab)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(None, _BATCH)))

    def gather(tree):
        """ZeRO-3 (FSDP): each shard gathered where it is used, the batch staying split;
        its transpose reduce-scatters the gradients."""
        if layout.zero < 3:
            return tree
        return jax.lax.with_sharding_constraint(
            tree, shard(_specs(tree, layout.replace(zero=0))))

    fe = spec.expert_ffn
    activation = ((lambda h: jax.nn.silu(h[..., :fe]) * h[..., fe:])
                  if spec.mlp == "swiglu" else jax.nn.gelu)

    # a MoE's (tp = 1) shard_map binds every axis: jaxpg's collectives find each rank there
    manual = {"dp", "ep", "tp"} if spec.is_moe else set(_BATCH)

    def moe_rank(x, router, w1, w2):
        """One rank's MoE layer (its tokens, the router, its experts); dropless."""
        return moe(x, router, w1, w2, group=ep_group, top_k=spec.top_k,
                   activation=activation)[0]

    def moe_sharded(x, router, w1, w2):
        """The MoE layer from jit's global arrays: a ``shard_map`` over ``dp x ep`` (at
        ``ep = 1`` each rank runs every expert on its own tokens, with no exchange)."""
        return jax.shard_map(moe_rank, mesh=mesh, in_specs=(P(_BATCH), P(), P("ep"), P("ep")),
                             out_specs=P(_BATCH), axis_names=manual,
                             check_vma=False)(x, router, w1, w2)

    dp = layout.dp

    def sharded_grads(params, tokens, moe_call=moe_sharded):
        """The gradients summed over the microbatches (ZeRO 2/3, over the whole mesh: every
        microbatch's reduce-scattered as they are made)."""
        grad_fn = jax.grad(lambda p, t: _loss(spec, layout.remat, p, t, gather, moe_call))

        def accumulate(acc, t):
            return jax.tree.map(jnp.add, acc, grad_fn(params, t)), None

        grads, _ = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), tokens)
        return grads

    def expert_leaf(path) -> bool:
        return getattr(path[-1], "key", None) in _EXPERTS

    rank_specs = jax.tree_util.tree_map_with_path(
        lambda path, _: P("ep") if expert_leaf(path) else P(), params)

    def local_grads(params, tokens):
        """ZeRO 0/1: each dp rank accumulates its own gradients over the microbatches and
        they are reduced once after them, as DDP's no_sync does (dp x ep manual, tp left to
        XLA; each rank holds its experts); left to itself, XLA would all-reduce every
        microbatch's."""
        def per_rank(params, tokens):
            acc = sharded_grads(params, tokens, moe_rank)
            return jax.tree_util.tree_map_with_path(
                lambda path, g: jax.lax.psum(g, "dp" if expert_leaf(path) else _BATCH) / dp,
                acc)

        return jax.shard_map(per_rank, mesh=mesh, in_specs=(rank_specs, P(None, _BATCH)),
                             out_specs=rank_specs, axis_names=manual,
                             check_vma=False)(params, tokens)

    def step(params, opt, tokens):
        grads = (local_grads if layout.zero <= 1 and dp > 1 else sharded_grads)(params, tokens)
        mu, nu = opt
        mu = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g / m, mu, grads)
        nu = jax.tree.map(lambda a, g: 0.999 * a + 0.001 * (g / m) ** 2, nu, grads)
        params = jax.tree.map(lambda p, a, b: p - 1e-4 * a / (jnp.sqrt(b) + 1e-8),
                              params, mu, nu)
        return params, (mu, nu)

    fn = jax.jit(step, out_shardings=(shard(pspecs), shard((opt_specs, opt_specs))),
                 donate_argnums=(0, 1))
    return fn, (params, opt, tokens)


def _check(job: Job, layout: Layout, devices):
    import jax

    if layout.pp > 1 or layout.cp > 1:
        raise ValueError(f"trial_step: layout {layout} has pp or cp > 1; trials run tp, ep, "
                         "the data-parallel axes, microbatches and recomputation only.")
    spec = job.model
    if layout.ep > 1 and not spec.is_moe:
        raise ValueError(f"trial_step: layout {layout} has ep={layout.ep} but the model has "
                         "no experts; use ep=1.")
    if spec.is_moe:
        if layout.tp > 1:
            raise ValueError(f"trial_step: layout {layout} splits a MoE over tp={layout.tp}; "
                             "MoE trials run ep and the data-parallel axes only (tp=1).")
        if spec.shared_experts:
            raise ValueError(f"trial_step: shared_experts={spec.shared_experts}; MoE trials "
                             "run routed experts only (shared_experts=0).")
        if layout.dp_shard % layout.ep or spec.experts % layout.ep:
            raise ValueError(f"trial_step: ep={layout.ep} must divide dp_shard="
                             f"{layout.dp_shard} and experts={spec.experts}.")
    devices = list(devices or jax.devices()[:job.devices])
    if len(devices) != layout.devices or layout.devices != job.devices:
        raise ValueError(f"trial_step: layout {layout} uses {layout.devices} devices; the job "
                         f"has {job.devices} and {len(devices)} are given.")
    return devices


class Trial:
    """One layout's training step, compiled for the devices with its first arguments placed:
    what :func:`trial_times` times, kept so that several layouts' steps can be timed in
    turns (each round one step of each, so that the machine's drift falls on all alike).

    Attributes:
        memory: the compiled step's memory on one device.
    """

    def __init__(self, compiled, args) -> None:
        self._fn = compiled
        self._params, self._opt, self._tokens = args
        self.memory = CompiledMemory.of(compiled)

    def step(self) -> tuple[float, float]:
        """Runs one training step; its wall-clock and CPU seconds (this process's)."""
        import jax

        begin, begin_cpu = time.perf_counter(), time.process_time()
        self._params, self._opt = jax.block_until_ready(
            self._fn(self._params, self._opt, self._tokens))
        return time.perf_counter() - begin, time.process_time() - begin_cpu


def compile_trial(job: Job, layout: Layout, *, devices=None, seed: int = 0) -> Trial:
    """``job``'s training step under ``layout``, compiled, its arguments on the devices.

    Args:
        job: the job (its devices are this machine's, ``job.devices`` of them).
        layout: a layout without pipeline or context parallelism.
        devices: the devices (default: the first ``job.devices`` local ones).
        seed: the parameters' and tokens' seed.
    """
    devices = _check(job, layout, devices)
    fn, args = _build(job, layout, devices, seed)
    return Trial(fn.lower(*args).compile(), args)


def trial_times(job: Job, layout: Layout, *, steps: int = 3, devices=None,
                seed: int = 0) -> TrialTimes:
    """Runs ``steps`` real training steps of ``job`` (after one warm-up step) and times each
    by wall clock and by this process's CPU time; the step's compiled memory comes with
    the times.

    Args:
        job: the job (its devices are this machine's, ``job.devices`` of them).
        layout: a layout without pipeline or context parallelism.
        steps: timed steps after the warm-up.
        devices: the devices (default: the first ``job.devices`` local ones).
        seed: the parameters' and tokens' seed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"trial_times: steps={steps!r} must be an int >= 1.")
    trial = compile_trial(job, layout, devices=devices, seed=seed)
    trial.step()
    wall, cpu = zip(*(trial.step() for _ in range(steps)))
    return TrialTimes(wall, cpu, trial.memory)


def trial_memory(job: Job, layout: Layout, *, devices=None, seed: int = 0) -> CompiledMemory:
    """The per-device memory of ``job``'s training step under ``layout``, as XLA compiles it
    (compiled only, not run).

    Args:
        job: the job (its devices are this machine's, ``job.devices`` of them).
        layout: a layout without pipeline or context parallelism.
        devices: the devices (default: the first ``job.devices`` local ones).
        seed: the parameters' and tokens' seed.
    """
    devices = _check(job, layout, devices)
    fn, args = _build(job, layout, devices, seed)
    return CompiledMemory.of(fn.lower(*args).compile())


def trial_step(job: Job, layout: Layout, *, steps: int = 3, devices=None, seed: int = 0,
               statistic: str = "median", clock: str = "wall") -> float:
    """The median (or fastest) seconds of ``steps`` real training steps of ``job``.

    Args:
        job: the job (its devices are this machine's, ``job.devices`` of them).
        layout: a layout without pipeline or context parallelism.
        steps: timed steps after one warm-up (compile) step.
        devices: the devices (default: the first ``job.devices`` local ones).
        seed: the parameters' and tokens' seed.
        statistic: ``"median"`` or ``"min"`` (the step least disturbed by other work).
        clock: ``"wall"``, or ``"cpu"``: this process's CPU seconds (:class:`TrialTimes`).
    """
    _check_figure("trial_step", clock, statistic)  # before the trial runs
    return trial_times(job, layout, steps=steps, devices=devices, seed=seed).seconds(
        clock, statistic)
