"""Worker: torch's PipelineStage and schedule classes in jaxpg, one pipeline rank per process.

    pipeline_stage_worker.py RANK WORLD PORT TORCH_PORT OUT_DIR

WORLD is 2 (everything below) or 4 (the tutorial in 4 stages, then the data-parallel
pipelines of ``pipeline_stage_dp_worker.py`` and the tensor-parallel stages of
``pipeline_stage_tp_worker.py``, which print ``CHECK <name> ok``).

Started by ``tests/multiprocess/test_pipeline_stage.py`` (rank 0 hosts the coordination
service; one CPU device per process). Writes ``OUT_DIR/rank{RANK}.npz`` with:

* ``tutorial``: torch's pipelining tutorial model (embedding + blocks + norm + head, split
  in 2 unequal stages, or in 4: embedding + block, block, block, norm + head), the same
  weights and data in torch (``torch.distributed.pipelining`` over gloo, when torch is
  installed) and in jaxpg, for ``Schedule1F1B`` (two steps without ``zero_grad``, an SGD
  update, a third step) and ``ScheduleGPipe`` (one step): every microbatch loss
  (``{lib}/{sched}/losses{step}``) and every parameter gradient
  (``{lib}/{sched}/grad{step}/{torch name}``) of this rank's stage.
  The un-pipelined model's microbatch losses and gradients: ``ref/losses1``,
  ``ref/grad1/{torch name}`` (``jax.grad`` here).
* ``multi`` (2 processes, where torch is installed): the tutorial model's 4 stages, 2 per
  process, under ``ScheduleDualPipeV`` (a V) and ``ScheduleLoopedBFS`` (a loop), in jaxpg
  and in torch pipelining: the same keys as ``tutorial`` (``{lib}/dualpipev/...``,
  ``{lib}/loopedbfs/...``) on every rank, the losses on the rank of the last stage.
* ``hetero``: a 4-piece model whose stages differ in shapes (widths 16, 12, 20, vocab)
  under the schedule classes of 2 stages per process (``hetero/{class}/...``), and the
  un-pipelined model's microbatch losses and gradients (``hetero/ref/...``, ``jax.grad``).
* ``mismatch``: two stages that do not fit (16 features out, 12 in), then a target that
  does not fit the loss: each rank's error texts, and an all_reduce after them.
* ``side``: integer position ids and a bool mask carried from stage 0 to stage 1 beside
  the activations, under ``Schedule1F1B`` and ``ScheduleGPipe`` (``side/{sched}/losses``,
  ``side/{sched}/stage{s}/...``), the un-pipelined model's (``side/ref/...``), and the error
  of a stage returning a dict (``side/error``).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

V, D, B, S, M, LR = 32, 16, 8, 6, 4, 0.5


# --------------------------------------------------------------------------- jaxpg models
class Block(nnx.Module):
    """``h + fc2(tanh(fc1(norm(h))))``, torch's ``Block`` below."""

    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, h):
        return h + self.fc2(jnp.tanh(self.fc1(self.norm(h))))


class TutorialStage(nnx.Module):
    """The tutorial's Transformer with the parts another stage holds left out."""

    def __init__(self, layers: list[int], first: bool, last: bool, rngs: nnx.Rngs) -> None:
        self.tok_embeddings = nnx.Embed(V, D, rngs=rngs) if first else None
        self.layers = nnx.List([Block(D, rngs) for _ in layers])
        self.norm = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs) if last else None
        self.output = nnx.Linear(D, V, rngs=rngs) if last else None

    def __call__(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.output(self.norm(h))
        return h


def ce_loss(logits, target):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.reshape(-1, V), target.reshape(-1)).mean()


# the tutorial's blocks per stage, by world size: 2 unequal stages (embedding + 2 blocks |
# block + head), or 4 (embedding + block | block | block | norm + head)
STAGE_LAYERS_BY_WORLD = {2: {0: [0, 1], 1: [2]}, 4: {0: [0], 1: [1], 2: [2], 3: []}}
STAGE_LAYERS = STAGE_LAYERS_BY_WORLD[2]
# two stages per process over 2 processes (the 4-stage split): each class's placement
MULTI_PLACEMENT = {"dualpipev": lambda r: (r, 3 - r), "loopedbfs": lambda r: (r, r + 2)}


def load_stage(stage: TutorialStage, weights: dict, r: int) -> None:
    """Copies torch's weights (``{torch name: array}``) into the stage's module."""
    def lin(mod, name):
        mod.kernel.value = jnp.asarray(weights[f"{name}.weight"].T)
        mod.bias.value = jnp.asarray(weights[f"{name}.bias"])

    def norm(mod, name):
        mod.scale.value = jnp.asarray(weights[f"{name}.weight"])
        mod.bias.value = jnp.asarray(weights[f"{name}.bias"])

    if stage.tok_embeddings is not None:
        stage.tok_embeddings.embedding.value = jnp.asarray(weights["tok_embeddings.weight"])
    for block, i in zip(stage.layers, STAGE_LAYERS[r], strict=True):
        norm(block.norm, f"layers.{i}.norm")
        lin(block.fc1, f"layers.{i}.fc1")
        lin(block.fc2, f"layers.{i}.fc2")
    if stage.norm is not None:
        norm(stage.norm, "norm")
        lin(stage.output, "output")


def stage_grads_by_torch_name(grads, r: int) -> dict:
    """The stage's ``grads`` (nnx.State) under torch's parameter names."""
    g = nnx.to_pure_dict(grads) if hasattr(nnx, "to_pure_dict") else grads
    out = {}
    if "tok_embeddings" in g and g["tok_embeddings"] is not None:
        out["tok_embeddings.weight"] = g["tok_embeddings"]["embedding"]
    for j, i in enumerate(STAGE_LAYERS[r]):
        blk = g["layers"][j]
        for part in ("fc1", "fc2"):
            out[f"layers.{i}.{part}.weight"] = np.asarray(blk[part]["kernel"]).T
            out[f"layers.{i}.{part}.bias"] = blk[part]["bias"]
        out[f"layers.{i}.norm.weight"] = blk["norm"]["scale"]
        out[f"layers.{i}.norm.bias"] = blk["norm"]["bias"]
    if "norm" in g and g["norm"] is not None:
        out["norm.weight"], out["norm.bias"] = g["norm"]["scale"], g["norm"]["bias"]
        out["output.weight"] = np.asarray(g["output"]["kernel"]).T
        out["output.bias"] = g["output"]["bias"]
    return {k: np.asarray(v) for k, v in out.items()}


# --------------------------------------------------------------------------- torch
def numpy_weights() -> dict:
    """The tutorial model's weights under torch's names (seeded numpy, both legs)."""
    rng = np.random.default_rng(1)
    f32 = lambda *shape, s=0.3: (rng.normal(size=shape) * s).astype(np.float32)  # noqa: E731
    w = {"tok_embeddings.weight": f32(V, D, s=1.0)}
    for i in range(3):
        w |= {f"layers.{i}.norm.weight": 1 + f32(D, s=0.1), f"layers.{i}.norm.bias": f32(D, s=0.1),
              f"layers.{i}.fc1.weight": f32(2 * D, D), f"layers.{i}.fc1.bias": f32(2 * D, s=0.1),
              f"layers.{i}.fc2.weight": f32(D, 2 * D), f"layers.{i}.fc2.bias": f32(D, s=0.1)}
    w |= {"norm.weight": 1 + f32(D, s=0.1), "norm.bias": f32(D, s=0.1),
          "output.weight": f32(V, D), "output.bias": f32(V, s=0.1)}
    return w


def torch_model(weights: dict):
    """The tutorial model in torch, with ``weights``."""
    import torch
    from torch import nn

    class TBlock(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, h):
            return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))

    class Transformer(nn.Module):  # the tutorial's, with TBlock for its decoder layer
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(V, D)
            self.layers = nn.ModuleDict({str(i): TBlock(D) for i in range(3)})
            self.norm = nn.LayerNorm(D)
            self.output = nn.Linear(D, V)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
            for layer in self.layers.values():
                h = layer(h)
            h = self.norm(h) if self.norm else h
            return self.output(h) if self.output else h

    model = Transformer()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


def torch_stage(model, r):
    """Pipeline rank ``r``'s stage of the torch model (``STAGE_LAYERS[r]``'s blocks)."""
    import copy

    stage = copy.deepcopy(model)
    for i in range(3):
        if i not in STAGE_LAYERS[r]:
            del stage.layers[str(i)]
    if r != 0:
        stage.tok_embeddings = None
    if r != len(STAGE_LAYERS) - 1:
        stage.norm = stage.output = None
    return stage


def run_torch(rank, world, port, weights, tokens, labels, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    model = torch_model(weights)

    def loss_fn(output, target):
        return torch.nn.functional.cross_entropy(output.reshape(-1, V), target.reshape(-1))

    def grads_of(mod, key):
        for name, prm in mod.named_parameters():
            out[f"{key}/{_torch_name(name)}"] = prm.grad.numpy().copy()

    x, y = torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))
    for sched_name, cls, steps in (("1f1b", Schedule1F1B, 3), ("gpipe", ScheduleGPipe, 1)):
        mod = torch_stage(model, rank)
        stage = PipelineStage(mod, rank, world, torch.device("cpu"))
        sched = cls(stage, M, loss_fn=loss_fn)
        opt = torch.optim.SGD(mod.parameters(), lr=LR)
        for step in range(1, steps + 1):
            if step == 3:  # train: update, clear, step again
                opt.step()
                opt.zero_grad()
            losses = []
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y, losses=losses)
                out[f"torch/{sched_name}/losses{step}"] = np.array(
                    [float(t.detach()) for t in losses])
            else:
                sched.step()
            grads_of(mod, f"torch/{sched_name}/grad{step}")
    if world == 2:
        run_torch_multi(rank, model, loss_fn, grads_of, x, y, out)
    dist.destroy_process_group()


def run_torch_multi(rank, model, loss_fn, grads_of, x, y, out):
    """torch's ScheduleDualPipeV and ScheduleLoopedBFS over the model's 4 stages."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleLoopedBFS

    global STAGE_LAYERS
    layers, STAGE_LAYERS = STAGE_LAYERS, STAGE_LAYERS_BY_WORLD[4]
    try:
        for name, cls in (("dualpipev", ScheduleDualPipeV), ("loopedbfs", ScheduleLoopedBFS)):
            held = MULTI_PLACEMENT[name](rank)
            mods = [torch_stage(model, s) for s in held]
            stages = [PipelineStage(mod, s, 4, torch.device("cpu"))
                      for mod, s in zip(mods, held, strict=True)]
            sched = cls(stages, M, loss_fn=loss_fn)
            losses = []
            args = (x,) if 0 in held else ()
            kwargs = {"target": y, "losses": losses} if 3 in held else {}
            sched.step(*args, **kwargs)
            if 3 in held:
                out[f"torch/{name}/losses1"] = np.array([float(t.detach()) for t in losses])
            for mod in mods:
                grads_of(mod, f"torch/{name}/grad1")
    finally:
        STAGE_LAYERS = layers


def _torch_name(name: str) -> str:
    return name  # ModuleDict keeps the full model's names ("layers.2.fc1.weight")


# --------------------------------------------------------------------------- jaxpg runs
def run_jaxpg_tutorial(rank, world, weights, tokens, labels, out):
    from jaxpg.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

    for sched_name, cls, steps in (("1f1b", Schedule1F1B, 3), ("gpipe", ScheduleGPipe, 1)):
        mod = TutorialStage(STAGE_LAYERS[rank], rank == 0, rank == world - 1, nnx.Rngs(rank))
        load_stage(mod, weights, rank)
        stage = PipelineStage(mod, rank, world)
        sched = cls(stage, M, loss_fn=ce_loss)
        tx = optax.sgd(LR)
        opt_state = tx.init(nnx.state(mod, nnx.Param))
        for step in range(1, steps + 1):
            if step == 3:
                params = nnx.state(mod, nnx.Param)
                updates, opt_state = tx.update(stage.grads, opt_state, params)
                nnx.update(mod, optax.apply_updates(params, updates))
                stage.zero_grad()
            losses = []
            if rank == 0:
                sched.step(tokens)
            elif rank == world - 1:
                logits = sched.step(target=labels, losses=losses)
                assert logits.shape == (B, S, V), logits.shape
                out[f"jax/{sched_name}/losses{step}"] = np.array([float(t) for t in losses])
            else:
                sched.step()
            for k, v in stage_grads_by_torch_name(stage.grads, rank).items():
                out[f"jax/{sched_name}/grad{step}/{k}"] = v
        out[f"jax/{sched_name}/recorded"] = np.array(recorded_steps(stage.group))


def run_jaxpg_multi(rank, weights, tokens, labels, out):
    """jaxpg's ScheduleDualPipeV and ScheduleLoopedBFS as ``run_torch_multi``."""
    import jaxpg.pipeline as pipeline

    global STAGE_LAYERS
    layers, STAGE_LAYERS = STAGE_LAYERS, STAGE_LAYERS_BY_WORLD[4]
    try:
        for name, cls in (("dualpipev", pipeline.ScheduleDualPipeV),
                          ("loopedbfs", pipeline.ScheduleLoopedBFS)):
            held = MULTI_PLACEMENT[name](rank)
            stages = []
            for s in held:
                mod = TutorialStage(STAGE_LAYERS[s], s == 0, s == 3, nnx.Rngs(s))
                load_stage(mod, weights, s)
                stages.append(pipeline.PipelineStage(mod, s, 4))
            sched = cls(stages, M, loss_fn=ce_loss)
            losses = []
            args = (tokens,) if 0 in held else ()
            kwargs = {"target": labels, "losses": losses} if 3 in held else {}
            sched.step(*args, **kwargs)
            if 3 in held:
                out[f"jax/{name}/losses1"] = np.array([float(t) for t in losses])
            for st, s in zip(stages, held, strict=True):
                for k, v in stage_grads_by_torch_name(st.grads, s).items():
                    out[f"jax/{name}/grad1/{k}"] = v
    finally:
        STAGE_LAYERS = layers


def recorded_steps(group):
    """This process's flight-recorder records of schedule steps on ``group``, oldest first:
    ``"Schedule1F1B.step #3 completed"``."""
    from jaxpg.supervision.flight_recorder import recorder

    return [f"{r.op} #{r.seq} {r.state}" for r in recorder.records()
            if r.kind == "pipeline" and r.group == group.group_name]


def tutorial_reference(weights, tokens, labels, out):
    """The whole tutorial model, un-pipelined: microbatch losses and mean gradients."""
    global STAGE_LAYERS
    layers, STAGE_LAYERS = STAGE_LAYERS, {0: [0, 1, 2]}  # the whole model as one stage
    try:
        full = TutorialStage([0, 1, 2], True, True, nnx.Rngs(0))
        load_stage(full, weights, 0)
        gd, params, rest = nnx.split(full, nnx.Param, ...)
        rows = B // M

        def mean_loss(params):
            model = nnx.merge(gd, params, rest)
            per = jnp.stack([ce_loss(model(tokens[i * rows:(i + 1) * rows]),
                                     labels[i * rows:(i + 1) * rows]) for i in range(M)])
            return per.mean(), per

        (_, per), g = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)
        out["ref/losses1"] = np.asarray(per)
        for k, v in stage_grads_by_torch_name(g, 0).items():
            out[f"ref/grad1/{k}"] = v
    finally:
        STAGE_LAYERS = layers


# hetero: four pieces of different widths; 2 stages = pieces (0, 1) and (2, 3)
class Chain(nnx.Module):
    def __init__(self, pieces: list) -> None:
        self.pieces = nnx.List(pieces)

    def __call__(self, h):
        for piece in self.pieces:
            h = piece(h)
        return h


class Embedder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, 16, rngs=rngs)
        self.block = Block(16, rngs)

    def __call__(self, tokens):
        return self.block(self.embed(tokens))


class Dense(nnx.Module):
    def __init__(self, d_in, d_out, rngs):
        self.lin = nnx.Linear(d_in, d_out, rngs=rngs)

    def __call__(self, h):
        return jax.nn.gelu(self.lin(h))


class Head(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.out = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h))


def piece(i: int):
    rngs = nnx.Rngs(10 + i)
    return [lambda: Embedder(rngs), lambda: Dense(16, 12, rngs), lambda: Dense(12, 20, rngs),
            lambda: Head(20, rngs)][i]()


def run_hetero(rank, world, tokens, labels, out):
    from jaxpg.pipeline import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )

    full = Chain([piece(i) for i in range(4)])
    gd, params = nnx.split(full, nnx.Param)

    def mean_loss(params):
        model = nnx.merge(gd, params)
        rows = B // M
        per = [ce_loss(model(tokens[i * rows:(i + 1) * rows]), labels[i * rows:(i + 1) * rows])
               for i in range(M)]
        return jnp.mean(jnp.stack(per)), jnp.stack(per)

    if rank == 0:  # the test reads the reference from rank 0
        (_, per), g = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)
        out["hetero/ref/losses"] = np.asarray(per)
        ref = nnx.to_pure_dict(g)["pieces"]
        for i in range(4):
            for k, v in _flat(ref[i]).items():
                out[f"hetero/ref/piece{i}/{k}"] = v

    n_proc = world
    cases = [("ScheduleInterleaved1F1B", ScheduleInterleaved1F1B,
              {0: [(0, [0]), (2, [2])], 1: [(1, [1]), (3, [3])]}),
             ("ScheduleInterleavedZeroBubble", ScheduleInterleavedZeroBubble,
              {0: [(0, [0]), (2, [2])], 1: [(1, [1]), (3, [3])]}),
             ("ScheduleZBVZeroBubble", ScheduleZBVZeroBubble,
              {0: [(0, [0]), (3, [3])], 1: [(1, [1]), (2, [2])]}),
             ("ScheduleLoopedBFS", ScheduleLoopedBFS,
              {0: [(0, [0]), (2, [2])], 1: [(1, [1]), (3, [3])]}),
             ("ScheduleDualPipeV", ScheduleDualPipeV,
              {0: [(0, [0]), (3, [3])], 1: [(1, [1]), (2, [2])]})]
    assert n_proc == 2
    for name, cls, placement in cases:
        mine = placement[rank]
        n_stages = sum(len(v) for v in placement.values())
        stages = [PipelineStage(Chain([piece(i) for i in pieces]), s, n_stages)
                  for s, pieces in mine]
        sched = cls(stages[0] if len(stages) == 1 else stages, M, loss_fn=ce_loss)
        losses = []
        holds = [s for s, _ in mine]
        kwargs = {}
        args = (tokens,) if 0 in holds else ()
        if n_stages - 1 in holds:
            kwargs = {"target": labels, "losses": losses}
        sched.step(*args, **kwargs)
        if losses:
            out[f"hetero/{name}/losses"] = np.array([float(t) for t in losses])
        for st, (_, pieces) in zip(stages, mine, strict=True):
            g = nnx.to_pure_dict(st.grads)["pieces"]
            for j, i in enumerate(pieces):
                for k, v in _flat(g[j]).items():
                    out[f"hetero/{name}/piece{i}/{k}"] = v


class PEmbed(nnx.Module):
    def __init__(self, seed):
        self.embed = nnx.Embed(V, D, rngs=nnx.Rngs(seed))

    def __call__(self, tokens):
        return self.embed(tokens)


class PBlock(Block):
    def __init__(self, seed):
        super().__init__(D, nnx.Rngs(seed))


class PHead(nnx.Module):
    def __init__(self, seed):
        self.out = nnx.Linear(D, V, rngs=nnx.Rngs(seed))

    def __call__(self, h):
        return self.out(h)


def paddle_layers():
    """Paddle's list: embedding, 4 Blocks, a plain function, the head."""
    from jaxpg.pipeline import LayerDesc

    return ([LayerDesc(PEmbed, 0)] + [LayerDesc(PBlock, 1 + i) for i in range(4)]
            + [jnp.tanh, LayerDesc(PHead, 5)])


def run_paddle(rank, world, tokens, labels, out):
    """PipelineLayer + train_batch (2 SGD steps) against the un-pipelined model."""
    from jaxpg.pipeline import PipelineLayer

    model = PipelineLayer(layers=paddle_layers(), num_stages=world, loss_fn=ce_loss,
                          seg_method="layer:PBlock", accumulate_steps=M)
    out["paddle/parts"] = np.asarray(model.segment_parts)
    tx = optax.sgd(LR)
    out["paddle/losses"] = np.array([model.train_batch([tokens, labels], tx) for _ in range(2)])
    for k, v in _flat(nnx.to_pure_dict(model.parameters())).items():
        out[f"paddle/params/{k}"] = v
    # the reference: every layer in this process, full-batch mean loss, 2 SGD steps
    built = [d.build_layer() if hasattr(d, "build_layer") else d for d in paddle_layers()]
    lo, hi = model.segment_parts[rank], model.segment_parts[rank + 1]
    mods = [b for b in built if isinstance(b, nnx.Module)]
    gd, params = nnx.split(nnx.List(mods), nnx.Param)

    def loss_of(params):
        layers = iter(nnx.merge(gd, params))
        h = tokens
        for b in built:
            h = next(layers)(h) if isinstance(b, nnx.Module) else b(h)
        return ce_loss(h, labels)

    losses = []
    loss_and_grads = jax.jit(jax.value_and_grad(loss_of))  # one program, not one per op
    for _ in range(2):
        loss, g = loss_and_grads(params)
        losses.append(float(loss))
        params = jax.tree.map(lambda p, g: p - LR * g, params, g)
    out["paddle/ref_losses"] = np.array(losses)
    ref = nnx.to_pure_dict(params)
    j = 0
    for i, b in enumerate(built):
        if isinstance(b, nnx.Module):
            if lo <= i < hi:
                for k, v in _flat(ref[j]).items():
                    out[f"paddle/ref_params/layer_{i - lo}.{k}"] = v
            j += 1


class Wide(nnx.Module):
    def __init__(self, d_in, d_out):
        self.lin = nnx.Linear(d_in, d_out, rngs=nnx.Rngs(0))

    def __call__(self, h):
        return self.lin(h)


def run_mismatched_stages(rank, out):
    """Stage 0 gives 16 features, stage 1 takes 12 (``mismatch/error``); then stages that
    fit and a target of 5 features for 4 outputs (``mismatch/loss_error``): Schedule1F1B's
    first step must raise the same ValueError on both ranks, before anything runs, and leave
    the world usable (``mismatch/after``: an all_reduce of the ranks)."""
    import jaxpg
    from jaxpg.pipeline import PipelineStage, Schedule1F1B

    for key, width, target in (("error", 12, (4, 4)), ("loss_error", 16, (4, 5))):
        stage = PipelineStage(Wide(8, 16) if rank == 0 else Wide(width, 4), rank, 2)
        schedule = Schedule1F1B(stage, 2, loss_fn=lambda y, t: jnp.mean((y - t) ** 2))
        try:
            if rank == 0:
                schedule.step(jnp.ones((4, 8)))
            else:
                schedule.step(target=jnp.zeros(target), losses=[])
            out[f"mismatch/{key}"] = np.array("no error")
        except ValueError as err:
            out[f"mismatch/{key}"] = np.array(str(err))
    out["mismatch/after"] = np.asarray(jaxpg.all_reduce(np.array([rank + 1.0], np.float32)))


# side inputs: integer position ids and a bool mask travel from stage 0 to stage 1 beside
# the activations; both stages use them (a position embedding each, the mask on stage 1)
class SideFirst(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(2 * S, D, rngs=rngs)
        self.block = Block(D, rngs)

    def __call__(self, tokens, positions, mask):
        return self.block(self.embed(tokens) + self.pos(positions)), positions, mask


class SideLast(nnx.Module):
    def __init__(self, rngs):
        self.pos = nnx.Embed(2 * S, D, rngs=rngs)
        self.block = Block(D, rngs)
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, h, positions, mask):
        h = jnp.where(mask[..., None], h + self.pos(positions), 0.0)
        return self.out(self.block(h))


class DictOut(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(8, 16, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return {"h": self.lin(x)}


def run_side_inputs(rank, tokens, labels, out):
    """Stage 0 returns (h, positions, mask), stage 1 takes them; positions are per-sample
    offsets (not arange: a stage recomputing them would differ), the mask random. Each
    schedule's losses and both stages' gradients (``side/{sched}/...``), the un-pipelined
    model's (``side/ref/...``), the last stage's returned logits; then a stage returning a
    dict: each rank's error (``side/error``)."""
    from jaxpg.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

    rng = np.random.default_rng(7)
    positions = jnp.asarray(rng.integers(0, S, size=(B, 1)) + np.arange(S), jnp.int32)
    mask = jnp.asarray(rng.random((B, S)) < 0.7)
    rows = B // M

    def model(seed):
        return [SideFirst(nnx.Rngs(seed)), SideLast(nnx.Rngs(seed + 1))]

    if rank == 0:
        first, last = model(3)
        (g0, p0), (g1, p1) = nnx.split(first, nnx.Param), nnx.split(last, nnx.Param)

        def mean_loss(p0, p1, positions):
            per = []
            for i in range(M):
                sl = slice(i * rows, (i + 1) * rows)
                h = nnx.merge(g0, p0)(tokens[sl], positions[sl], mask[sl])
                per.append(ce_loss(nnx.merge(g1, p1)(*h), labels[sl]))
            return jnp.mean(jnp.stack(per)), jnp.stack(per)

        (_, per), grads = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1),
                                                     has_aux=True))(p0, p1, positions)
        out["side/ref/losses"] = np.asarray(per)
        # what a stage recomputing its positions (arange) would give instead
        out["side/ref/losses_arange"] = np.asarray(jax.jit(mean_loss)(
            p0, p1, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))[1])
        for s, g in enumerate(grads):
            for k, v in _flat(nnx.to_pure_dict(g)).items():
                out[f"side/ref/stage{s}/{k}"] = v
    for name, cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        stage = PipelineStage(model(3)[rank], rank, 2)
        sched = cls(stage, M, loss_fn=ce_loss)
        if rank == 0:
            sched.step(tokens, positions, mask)
        else:
            losses = []
            logits = sched.step(target=labels, losses=losses)
            assert logits.shape == (B, S, V), logits.shape
            out[f"side/{name}/losses"] = np.array([float(t) for t in losses])
        for k, v in _flat(nnx.to_pure_dict(stage.grads)).items():
            out[f"side/{name}/stage{rank}/{k}"] = v
    stage = PipelineStage(DictOut() if rank == 0 else Wide(16, 4), rank, 2)
    sched = Schedule1F1B(stage, 2, loss_fn=lambda y, t: jnp.mean((y - t) ** 2))
    try:
        if rank == 0:
            sched.step(jnp.ones((4, 8)))
        else:
            sched.step(target=jnp.zeros((4, 4)), losses=[])
        out["side/error"] = np.array("no error")
    except TypeError as err:
        out["side/error"] = np.array(str(err))


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def main() -> None:
    rank, world, port, torch_port, out_dir = (int(sys.argv[1]), int(sys.argv[2]),
                                              int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    import jaxpg

    global STAGE_LAYERS
    STAGE_LAYERS = STAGE_LAYERS_BY_WORLD[world]
    jaxpg.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=120))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(B, S)).astype(np.int32)
    labels = rng.integers(0, V, size=(B, S)).astype(np.int32)
    out: dict[str, np.ndarray] = {}
    weights = numpy_weights()
    start = time.perf_counter()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: no torch pipeline to compare with", flush=True)
    else:
        run_torch(rank, world, torch_port, weights, tokens, labels, out)
        print(f"torch {time.perf_counter() - start:.1f} s", flush=True)
        if world == 2:  # torch's keys are its reference (the test compares every one)
            start = time.perf_counter()
            run_jaxpg_multi(rank, weights, tokens, labels, out)
            print(f"jaxpg dualpipev and loopedbfs {time.perf_counter() - start:.1f} s",
                  flush=True)
    start = time.perf_counter()
    run_jaxpg_tutorial(rank, world, weights, tokens, labels, out)
    if rank == 0:  # the test reads the reference from rank 0
        tutorial_reference(weights, jnp.asarray(tokens), jnp.asarray(labels), out)
    print(f"jaxpg tutorial {time.perf_counter() - start:.1f} s", flush=True)
    if world == 4:
        from pipeline_stage_dp_worker import run_data_parallel

        start = time.perf_counter()
        run_data_parallel(tokens, labels)
        print(f"jaxpg data parallel {time.perf_counter() - start:.1f} s", flush=True)
        from pipeline_stage_tp_worker import run_tensor_parallel

        start, cpu = time.perf_counter(), time.process_time()
        run_tensor_parallel(tokens, labels)
        print(f"jaxpg tensor parallel {time.perf_counter() - start:.1f} s "
              f"({time.process_time() - cpu:.1f} s CPU)", flush=True)
        from pipeline_stage_ep_worker import run_expert_parallel

        start, cpu = time.perf_counter(), time.process_time()
        run_expert_parallel(np.random.default_rng(2))
        print(f"jaxpg expert parallel {time.perf_counter() - start:.1f} s "
              f"({time.process_time() - cpu:.1f} s CPU)", flush=True)
        from pipeline_stage_cp_worker import run_context_parallel

        start, cpu = time.perf_counter(), time.process_time()
        run_context_parallel(np.random.default_rng(1))
        print(f"jaxpg context parallel {time.perf_counter() - start:.1f} s "
              f"({time.process_time() - cpu:.1f} s CPU)", flush=True)
        from pipeline_stage_dp_worker import run_pipeline_layer_data_parallel

        start = time.perf_counter()
        run_pipeline_layer_data_parallel(tokens, labels)  # last: it makes hybrid groups
        print(f"jaxpg PipelineLayer data parallel {time.perf_counter() - start:.1f} s",
              flush=True)
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
        jaxpg.destroy_process_group()
        print("DONE", flush=True)
        return
    start = time.perf_counter()
    run_hetero(rank, world, jnp.asarray(tokens), jnp.asarray(labels), out)
    print(f"jaxpg hetero {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    run_paddle(rank, world, jnp.asarray(tokens), jnp.asarray(labels), out)
    print(f"jaxpg paddle {time.perf_counter() - start:.1f} s", flush=True)
    run_mismatched_stages(rank, out)
    start = time.perf_counter()
    run_side_inputs(rank, jnp.asarray(tokens), jnp.asarray(labels), out)
    print(f"jaxpg side inputs {time.perf_counter() - start:.1f} s", flush=True)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    jaxpg.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
