"""The compiled pipeline loop copies no weight-sized array per tick.

XLA copies every output of a conditional with more than two branches in each branch,
so a weight-gradient accumulator carried through a ``lax.switch`` was copied whole on
every tick (and slicing the ``[v, ...]`` parameter stack per tick copied the weights).
The executor now runs a tick as two-way conds that update the accumulators in place;
these tests read the optimized HLO of the loop body and assert that no copy of an
array with the weights' shape is left in it, for every schedule and both remat modes.

Nor of a slot buffer: a tick's steps return only what they write (the rest of the
state is a read-only cond operand), and what a tick receives is stored at the start of
the next one, before any step reads the buffers. Stored at the end of the tick, after
``W`` read them, XLA copied both activation-slot buffers twice a tick in split schedules.

Nor does it recompute a forward without remat: the loop holds each of the stage's matmuls
once per action, as many for ZB-H1's split ``B`` + ``W`` as for 1F1B's whole backward.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxpg.pipeline.api import pipeline_value_and_grad
from jaxpg.pipeline.lockstep.hlo_loop import computations, count_in_loop, loop_bodies, loop_text

# meshes of 2 to 8 devices: not on one GPU (tools/gpu_check.sh)
pytestmark = pytest.mark.cpu_only

D, H, ROWS = 8, 40, 4  # [8, 40] and [40, 8] are the weights' shapes and nothing else's


def block(w, x):
    return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def mse(_, y, t):
    return jnp.mean((y - t) ** 2)


@functools.cache
def loop_hlo(name, v, remat, p=2, m=4):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (p * v, D, H)),
        "w2": jax.random.normal(k2, (p * v, H, D)),
    }
    x = jnp.ones((m * ROWS, D))
    mesh = Mesh(np.array(jax.devices()[:p]), ("pp",))

    def step(params, x):
        return pipeline_value_and_grad(
            block, mse, params, x, x, mesh=mesh, schedule=name, num_microbatches=m,
            remat=remat,
        )  # fmt: skip

    return jax.jit(step).lower(params, x).compile().as_text()


def computations_in_loop(hlo: str) -> str:
    """The text of the while loops' bodies and every computation they call."""
    assert loop_bodies(computations(hlo)), "no while loop in the compiled step"
    return loop_text(hlo)


CASES = [("1f1b", 1, False), ("1f1b", 1, True), ("zb_h1", 1, False), ("zb_h1", 1, True),
         ("interleaved_1f1b", 2, False), ("zb_v", 2, False)]  # fmt: skip


@pytest.mark.parametrize("name,v,remat", CASES)
def test_no_weight_sized_copy_in_the_loop(name, v, remat):
    loop = computations_in_loop(loop_hlo(name, v, remat))
    assert " dot(" in loop or "fusion(" in loop  # the stage's work is in the loop
    weight_copies = [
        line.strip() for line in loop.splitlines()
        if " copy(" in line and re.search(rf"f32\[(?:\d+,)*(?:{D},{H}|{H},{D})\]", line)
    ]  # fmt: skip
    assert not weight_copies, weight_copies


@pytest.mark.parametrize("name,v,remat", CASES)
def test_no_slot_buffer_copy_in_the_loop(name, v, remat):
    loop = computations_in_loop(loop_hlo(name, v, remat))
    slot_copies = [  # a [slots, ROWS, D] activation or gradient slot buffer
        line.strip() for line in loop.splitlines()
        if " copy(" in line and re.search(rf"= f32\[\d+,{ROWS},{D}\]", line)
    ]  # fmt: skip
    assert not slot_copies, slot_copies


@pytest.mark.parametrize("name,v,p,want", [("1f1b", 1, 2, 1), ("zb_v", 2, 2, 1), ("1f1b", 1, 4, 2)])
def test_one_transfer_per_tick_and_way(name, v, p, want):
    """A tick sends its message to r + 1 and r - 1 (two ring ppermutes); with p = 2 both
    are one swap of one message, which XLA runs once: one collective-permute a tick (one
    gloo round trip across processes), two from p = 3 on."""
    hlo = loop_hlo(name, v, False, p=p, m=4)
    assert count_in_loop(hlo, " collective-permute(") == want


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_kept_residuals_recompute_no_matmul(name):
    """Without remat the loop runs the block's 2 forward matmuls in ``F`` and its 4
    backward ones (an input and a weight gradient for each) in ``B`` (and ``W``): 6,
    the split schedule as many as 1F1B. With remat the backward recomputes the forward,
    so its loop holds more: a count of 6 in both modes (both recompute) or above 6
    without remat (the residuals not kept, or ``W`` redoing ``B``'s work) fails."""
    keep, remat = (count_in_loop(loop_hlo(name, 1, r), " dot(") for r in (False, True))
    assert keep == 2 + 4, keep
    assert remat > keep, (remat, keep)
