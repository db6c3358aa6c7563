"""Context parallelism through the wrappers: DDP and FSDP with ``context_parallel=`` (and
DDP over a tensor-parallel model) train a small GPT as one device does on the whole batch,
and bad layouts are refused before anything runs."""

import jax
import numpy as np
import optax
import pytest
from _tiny_gpt import GPT, batches, loss_fn, one_device
from flax import nnx

import jaxpg
from jaxpg import tensor_parallel as tp
from jaxpg.context_parallel import ContextParallelAttention, SequenceSplit
from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel


def _tp_plan():
    return {"block.qkv": ColwiseParallel(), "block.proj": RowwiseParallel(),
            "block.up": ColwiseParallel(), "block.down": RowwiseParallel()}


CASES = {
    # wrapper, mesh shape and names, the data-parallel dims flattened with cp, method
    "ddp-dp4-cp2": ("ddp", (4, 2), ("dp", "cp"), ("dp", "cp"), "ring"),
    "fsdp-shard2-cp4": ("fsdp", (2, 4), ("dp_shard", "cp"), ("dp_shard", "cp"), "ring"),
    "ddp-dp2-cp2-tp2": ("ddp", (2, 2, 2), ("dp", "cp", "tp"), ("dp", "cp"), "all_to_all"),
    "fsdp-shard2-cp2-tp2": ("fsdp", (2, 2, 2), ("dp_shard", "cp", "tp"), ("dp_shard", "cp"),
                            "ring"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wrapper_with_context_parallel_trains_as_one_device(case):
    wrapper, shape, names, flat, method = CASES[case]
    optimizer = optax.sgd(0.5)  # SGD: a gradient off by a factor moves the parameters by it
    want_losses, want_params = one_device(optimizer)

    mesh = jaxpg.init_device_mesh(shape, names)
    group = mesh[flat]._flatten("dp_cp")
    model = GPT(ContextParallelAttention(group=mesh["cp"], causal=True, method=method))
    if "tp" in names:
        tp.parallelize_module(model, mesh["tp"], _tp_plan(), src_data_rank=None)
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model, optimizer, group=group,
                                                context_parallel=mesh["cp"])
    else:
        wrapped = FullyShardedDataParallel(model, optimizer, group=group,
                                                 context_parallel=mesh["cp"])
    axes = wrapped.step_mesh.dp_axes if wrapper == "ddp" else wrapped.group.shard_axes
    assert axes == flat  # gradients averaged (FSDP: parameters sharded) over dp x cp
    losses = [float(wrapped.train_step(loss_fn, batch)["loss"]) for batch in batches()]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    got = nnx.state(wrapped.module, nnx.Param)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree_util.tree_leaves_with_path(want_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_parallel_dims_names_the_groups_as_torchtitan():
    """``ParallelDims(dp_shard=2, cp=4)``: FSDP over ``dims["dp_shard_cp"]`` with
    ``context_parallel=dims`` (its cp axis) trains as one device does."""
    from jaxpg.groups.parallel_dims import ParallelDims

    want_losses, _ = one_device(optax.sgd(0.5))
    dims = ParallelDims(dp_shard=2, cp=4)
    model = GPT(ContextParallelAttention(group=dims, causal=True))
    fsdp = FullyShardedDataParallel(model, optax.sgd(0.5), group=dims["dp_shard_cp"],
                                    context_parallel=dims)
    losses = [float(fsdp.train_step(loss_fn, b)["loss"]) for b in batches()]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)


def test_contiguous_layout_and_another_sequence_dim():
    """``SequenceSplit(seq_dim=2, load_balance=False)``: a leaf with a leading extra axis
    after the samples, laid out contiguously, as a non-balanced layer expects."""
    optimizer = optax.sgd(0.1)
    want_losses, _ = one_device(optimizer)
    mesh = jaxpg.init_device_mesh((4, 2), ("dp", "cp"))
    group = mesh["dp", "cp"]._flatten("dp_cp")
    model = GPT(ContextParallelAttention(group=mesh["cp"], causal=True, load_balance=False))
    ddp = DistributedDataParallel(
        model, optimizer, group=group,
        context_parallel=SequenceSplit(mesh["cp"], seq_dim=2, load_balance=False))

    def loss2(model, batch):  # every leaf is (samples, 1, seq)
        return loss_fn(model, {k: v[:, 0] for k, v in batch.items()})

    losses = [float(ddp.train_step(loss2, {k: v[:, None] for k, v in b.items()})["loss"])
              for b in batches()]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)


def test_bad_context_parallel_layouts_are_refused_first():
    mesh = jaxpg.init_device_mesh((4, 2), ("dp", "cp"))
    model = GPT(ContextParallelAttention(group=mesh["cp"]))
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"not the cp axis 'cp'.*\.flatten\('dp_cp'\)"):
        DistributedDataParallel(model, opt, group=mesh["dp"], context_parallel=mesh["cp"])
    with pytest.raises(ValueError, match=r"seq_dim=0 must be 1 or more"):
        DistributedDataParallel(model, opt, group=mesh["dp"],
                                      context_parallel=SequenceSplit(mesh["cp"], seq_dim=0))
    with pytest.raises(TypeError, match=r"load_balance=1 must be a bool"):
        FullyShardedDataParallel(
            model, opt, group=mesh["dp"], context_parallel=SequenceSplit(mesh["cp"], 1, 1))
    with pytest.raises(ValueError, match=r"HSDP and hybrid groups do not compose with "
                                         r"context parallelism.*\.flatten\('dp_shard_cp'\)"):
        FullyShardedDataParallel(model, opt, group=mesh, context_parallel=mesh["cp"])
    ddp = DistributedDataParallel(model, opt, group=mesh["dp", "cp"]._flatten("dp_cp"),
                                        context_parallel=mesh["cp"])
    batch = next(batches())
    short = {k: v[:, :6] for k, v in batch.items()}  # 6 tokens: not 2·cp = 4 chunks
    with pytest.raises(ValueError, match=r"\['ids'\].*sequence dimension \(seq_dim=1\) of 6 "
                                         r"does not divide into 2·cp = 4 chunks"):
        ddp.train_step(loss_fn, short)
    with pytest.raises(ValueError, match=r"leading \(sample\) dimension must divide evenly "
                                         r"among this process's 4"):
        ddp.train_step(loss_fn, {k: v[:6] for k, v in batch.items()})
    assert ddp.step == 0


def test_cp_errors_name_each_wrappers_flattened_dimension():
    """DDP averages over ``dp_cp``, FSDP shards over ``dp_shard_cp``: each error names its
    own, and a ``context_parallel=`` that is not the cp dimension says so."""
    mesh = jaxpg.init_device_mesh((4, 2), ("dp", "cp"))
    model = GPT(ContextParallelAttention(group=mesh["cp"]))
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel: .*not the cp axis 'cp'.*"
                                         r"group=mesh\['dp', 'cp'\]\.flatten\('dp_shard_cp'\) "
                                         r"\(ParallelDims: dims\['dp_shard_cp'\]\)") as err:
        FullyShardedDataParallel(model, opt, group=mesh["dp"], context_parallel=mesh["cp"])
    assert "dp_cp" not in str(err.value)
    with pytest.raises(ValueError, match=r"HSDP and hybrid groups .*group=mesh\['dp', 'cp'\]"
                                         r"\.flatten\('dp_shard_cp'\)"):
        FullyShardedDataParallel(model, opt, group=mesh, context_parallel=mesh["cp"])
    with pytest.raises(ValueError, match=r"DistributedDataParallel: group=DeviceMesh.* with "
                                         r"context_parallel=.*group=mesh\['dp', 'cp'\]"
                                         r"\.flatten\('dp_cp'\) \(ParallelDims: dims\['dp_cp'\]\)"):
        DistributedDataParallel(model, opt, group=mesh, context_parallel=mesh["cp"])
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):
        with pytest.raises(ValueError, match=r"context_parallel= takes the context-parallel "
                                             r"dimension, but got a 2-D DeviceMesh.*pass "
                                             r"context_parallel=mesh\['cp'\]"):
            wrapper(model, opt, group=flat, context_parallel=mesh)
    dims = jaxpg.ParallelDims(dp_shard=4, cp=2, world_size=8)
    with pytest.raises(ValueError, match=r"has \{'cp': 2\}.*With context parallelism pass the "
                                         r"shard and cp dimensions flattened, "
                                         r"group=dims\['dp_shard_cp'\], and "
                                         r"context_parallel=dims\['cp'\]\.$") as err:
        FullyShardedDataParallel(model, opt, group=dims, context_parallel=dims)
    assert "pipeline" not in str(err.value)
    fsdp = FullyShardedDataParallel(GPT(ContextParallelAttention(group=dims["cp"])), opt,
                                    group=dims["dp_shard_cp"], context_parallel=dims["cp"])
    assert fsdp.group.shard_axes == ("dp_shard", "cp")  # the fix the error names works
    hcg = jaxpg.HybridCommunicateGroup(dp_degree=1, sharding_degree=4, sep_degree=2)
    sep = hcg.get_sep_parallel_group()
    model = GPT(ContextParallelAttention(group=sep))
    with pytest.raises(ValueError, match=r"has \{'sep': 2\}.*group=hcg\.device_mesh\['sharding', "
                                         r"'sep'\]\.flatten\('sharding_sep'\), and "
                                         r"context_parallel=hcg\.get_sep_parallel_group\(\)\.$"):
        FullyShardedDataParallel(model, opt, group=hcg, context_parallel=sep)
    fsdp = FullyShardedDataParallel(
        model, opt, group=hcg.device_mesh["sharding", "sep"]._flatten("sharding_sep"),
        context_parallel=sep)
    assert fsdp.group.shard_axes == ("sharding", "sep")
