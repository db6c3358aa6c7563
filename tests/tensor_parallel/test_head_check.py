"""tp against attention heads: a plan that would give a rank part of a head is refused by
``parallelize_module`` before anything runs, naming tp, the split and the degrees that fit;
the models that name no heads, and splits that heads do not constrain, are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpg
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class SelfAttention(nnx.Module):
    """Fused head-major QKV, as the torch habit writes it: ``head_dim`` and ``num_heads``."""

    def __init__(self, d: int, num_heads: int, num_kv_heads: int | None = None, seed=0):
        rngs = nnx.Rngs(seed)
        self.num_heads, self.head_dim = num_heads, d // num_heads
        if num_kv_heads is not None:
            self.num_kv_heads = num_kv_heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, -1, 3 * self.head_dim), 3, axis=-1)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, axis=-1), v)
        return self.out(y.reshape(b, t, -1))


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, attention: bool = True):
        self.heads = heads  # a block's own record of its heads
        self.attn = SelfAttention(d, heads) if attention else None
        self.up = nnx.Linear(d, 4 * d, rngs=nnx.Rngs(1))
        self.down = nnx.Linear(4 * d, d, rngs=nnx.Rngs(2))


ATTN_PLAN = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel()}


def test_three_heads_over_tp2_is_refused_before_anything_runs():
    mesh = jaxpg.init_device_mesh((4, 2), ("dp", "tp"))
    model = SelfAttention(12, num_heads=3)
    with pytest.raises(ValueError, match=r"parallelize_module: tp=2 \(device_mesh\) splits "
                                         r"'qkv' \(ColwiseParallel, out_features=36: 9 heads "
                                         r"of \(root\)\.head_dim=4\) into 9/2 heads per rank; "
                                         r"use a tp that divides 9 \(one of \[1, 3, 9\]\)"):
        parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(),
                                               "out": RowwiseParallel()})
    assert type(model.qkv) is nnx.Linear  # nothing was changed
    np.testing.assert_array_equal(np.asarray(model.qkv.kernel[...]),
                                  np.asarray(SelfAttention(12, 3).qkv.kernel[...]))
    with pytest.raises(ValueError, match=r"tp=2 .*splits 'attn\.out' \(RowwiseParallel, "
                                         r"in_features=12: 3 heads of attn\.head_dim=4\)"):
        parallelize_module(Block(12, 3), mesh["tp"], {"attn.out": RowwiseParallel()})


def test_head_counts_of_an_attention_module_are_checked():
    mesh = jaxpg.init_device_mesh((2, 4), ("dp", "tp"))
    # 8 query heads of 2, 2 kv heads: tp = 4 divides the split widths but not num_kv_heads
    model = SelfAttention(16, num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"tp=4 \(device_mesh\) does not divide "
                                         r"\(root\)\.num_kv_heads=2, and the plan splits 'qkv'"
                                         r".*each rank would hold 2/4 heads; use a tp that "
                                         r"divides 2 \(one of \[1, 2\]\)"):
        parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(),
                                               "out": RowwiseParallel()})


def test_splits_that_heads_do_not_constrain_pass():
    mesh = jaxpg.init_device_mesh((4, 2), ("dp", "tp"))
    # the MLP of a 3-head block: its widths are not split by heads (the block's own `heads`
    # is no attention's), so tp = 2 is fine
    block = parallelize_module(Block(12, 3, attention=False), mesh["tp"],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert block.up.kernel[...].sharding.spec[1] == "tp"
    # whole heads per rank: 4 heads over tp = 2 trains as it did
    model = SelfAttention(16, num_heads=4)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
    want = np.asarray(model(x))
    parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(), "out": RowwiseParallel()})
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5, atol=1e-5)
