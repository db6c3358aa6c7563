"""jaxpg.pipeline.lockstep.hlo_loop: reading what a compiled step runs inside its while loop."""

import doctest

import jax
import jax.numpy as jnp

from jaxpg.pipeline.lockstep import hlo_loop
from jaxpg.pipeline.lockstep.hlo_loop import (
    computations,
    count_in_loop,
    loop_computations,
    loop_text,
)

# A while body that calls a two-way conditional (one dot in one branch, two in the other)
# and the same fused computation twice; one dot outside the loop, one in a computation
# nothing in the loop calls.
HLO = """\
HloModule hand_written

%branch_a (pa: f32[2,2]) -> f32[2,2] {
  %pa = f32[2,2]{1,0} parameter(0)
  ROOT %da = f32[2,2]{1,0} dot(%pa, %pa), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_b (pb: f32[2,2]) -> f32[2,2] {
  %pb = f32[2,2]{1,0} parameter(0)
  %db1 = f32[2,2]{1,0} dot(%pb, %pb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %db2 = f32[2,2]{1,0} dot(%db1, %pb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused.1 (pf: f32[2,2]) -> f32[2,2] {
  %pf = f32[2,2]{1,0} parameter(0)
  ROOT %df = f32[2,2]{1,0} dot(%pf, %pf), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%unused (pu: f32[2,2]) -> f32[2,2] {
  %pu = f32[2,2]{1,0} parameter(0)
  ROOT %du = f32[2,2]{1,0} dot(%pu, %pu), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[2,2])) -> (s32[], f32[2,2]) {
  %t = (s32[], f32[2,2]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[2,2]{1,0} get-tuple-element(%t), index=1
  %c = f32[2,2]{1,0} conditional(%i, %x, %x), branch_computations={%branch_a, %branch_b}
  %f1 = f32[2,2]{1,0} fusion(%c), kind=kOutput, calls=%fused.1
  %f2 = f32[2,2]{1,0} fusion(%f1), kind=kOutput, calls=%fused.1
  ROOT %r = (s32[], f32[2,2]{1,0}) tuple(%i, %f2)
}

%cond (tc: (s32[], f32[2,2])) -> pred[] {
  %tc = (s32[], f32[2,2]{1,0}) parameter(0)
  ROOT %k = pred[] constant(false)
}

ENTRY %main (x0: f32[2,2]) -> f32[2,2] {
  %x0 = f32[2,2]{1,0} parameter(0)
  %d0 = f32[2,2]{1,0} dot(%x0, %x0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = s32[] constant(0)
  %t0 = (s32[], f32[2,2]{1,0}) tuple(%z, %d0)
  %w = (s32[], f32[2,2]{1,0}) while(%t0), condition=%cond, body=%body
  ROOT %out = f32[2,2]{1,0} get-tuple-element(%w), index=1
}
"""


def test_computations_split_the_text():
    comps = computations(HLO)
    assert list(comps) == [
        "%branch_a", "%branch_b", "%fused.1", "%unused", "%body", "%cond", "%main"
    ]  # fmt: skip
    assert sum(" dot(" in line for line in comps["%branch_b"]) == 2
    assert comps["%main"][-1] == "}"


def test_loop_computations_each_once_and_nothing_outside():
    assert set(loop_computations(HLO)) == {"%body", "%branch_a", "%branch_b", "%fused.1"}
    text = loop_text(HLO)
    assert text.count(" dot(") == 1 + 2 + 1  # fused.1 once, though called twice
    assert "%du" not in text and "%d0" not in text


def test_count_in_loop_per_call_site():
    # branch_a + branch_b + fused.1 twice; the entry's and %unused's dots do not count
    assert count_in_loop(HLO, " dot(") == 1 + 2 + 1 + 1
    assert count_in_loop(HLO, " conditional(") == 1


def test_no_loop():
    no_loop = HLO.replace(", condition=%cond, body=%body", "")
    assert loop_computations(no_loop) == {} and loop_text(no_loop) == ""
    assert count_in_loop(no_loop, " dot(") == 0


def test_scan_body_matmuls_in_compiled_hlo():
    def f(x, w1, w2, w3):
        def step(c, _):
            return jnp.tanh(jnp.tanh(c @ w1) @ w2) @ w3, None

        return jax.lax.scan(step, x @ w1, None, length=4)[0]  # one dot outside the loop

    a = jnp.ones((4, 4))
    hlo = jax.jit(f).lower(a, a, a, a).compile().as_text()
    assert count_in_loop(hlo, " dot(") == 3
    assert loop_text(hlo).count(" dot(") == 3
    assert hlo.count(" dot(") == 4


def test_docstring_example_runs():
    result = doctest.testmod(hlo_loop)
    assert result.attempted > 0 and result.failed == 0
