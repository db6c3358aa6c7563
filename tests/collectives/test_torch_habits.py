"""torch habits meet jaxpg: each gets a clear error or warning instead of wrong numbers.

In-place calls whose result is dropped warn; torch's output-argument signatures raise a
TypeError that shows jaxpg's form; inputs that are not arrays (torch tensors, Python lists)
raise a TypeError naming the op and the conversion; 64-bit numpy data never changes silently.
One process, 8 simulated ranks (the world from tests/conftest.py).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _require import import_or_skip

import jaxpg

X = jnp.arange(8.0, dtype=jnp.float32)[:, None] * jnp.ones((8, 2), jnp.float32)


def test_a_discarded_result_warns_once_per_line_and_a_kept_one_does_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxpg.all_reduce(X)  # torch's in-place habit: the sum is lost
        kept = jaxpg.all_reduce(X)
        _ = jaxpg.broadcast(X, src=0)
    discarded = [w for w in caught if issubclass(w.category, jaxpg.DiscardedResultWarning)]
    assert len(discarded) == 1, [str(w.message) for w in caught]
    assert "tensor = jaxpg.all_reduce(tensor" in str(discarded[0].message)
    assert discarded[0].filename == __file__  # points at the user's line
    np.testing.assert_allclose(np.asarray(kept), np.full((8, 2), 28.0))


def test_results_used_inside_expressions_or_spmd_code_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpg.DiscardedResultWarning)
        total = float(jaxpg.all_reduce(X).sum())
        assert total == 8 * 2 * 28.0

        @jaxpg.spmd
        def step(v):
            jaxpg.all_reduce(v)  # dead code in a trace: XLA drops it, nothing to warn
            return jaxpg.all_reduce(v) * 2

        np.testing.assert_allclose(np.asarray(step(X)), np.full((8, 2), 56.0))


@pytest.mark.parametrize("call, form", [
    (lambda: jaxpg.all_gather([X, X], X), "tensor_list = jaxpg.all_gather(tensor)"),
    (lambda: jaxpg.all_gather_into_tensor(X, X),
     "output_tensor = jaxpg.all_gather_into_tensor(input_tensor)"),
    (lambda: jaxpg.gather(X, gather_list=[X] * 8, dst=0),
     "gather_list = jaxpg.gather(tensor, dst=dst)"),
    (lambda: jaxpg.gather(X, [X] * 8, 0), "gather_list = jaxpg.gather(tensor, dst=dst)"),
    (lambda: jaxpg.reduce_scatter(X, [X] * 8), "output = jaxpg.reduce_scatter(input_list, op)"),
    (lambda: jaxpg.reduce_scatter_tensor(X, X), "output = jaxpg.reduce_scatter_tensor(input, op)"),
    (lambda: jaxpg.all_to_all([X] * 8, [X] * 8),
     "output_tensor_list = jaxpg.all_to_all(input_tensor_list)"),
    (lambda: jaxpg.all_to_all_single(X, X),
     "output = jaxpg.all_to_all_single(input, output_split_sizes, input_split_sizes)"),
    (lambda: jaxpg.all_gather_object([None] * 8, {"a": 1}),
     "object_list = jaxpg.all_gather_object(obj)"),
])
def test_torchs_output_argument_forms_raise_showing_jaxpgs_form(call, form):
    with pytest.raises(TypeError, match="looks like torch's") as info:
        call()
    assert form in str(info.value)


@pytest.mark.parametrize("call, op", [
    (lambda t: jaxpg.all_reduce(t), "all_reduce"),
    (lambda t: jaxpg.broadcast(t, src=0), "broadcast"),
    (lambda t: jaxpg.reduce_scatter_tensor(t), "reduce_scatter_tensor"),
    (lambda t: jaxpg.all_gather(t), "all_gather"),
    (lambda t: jaxpg.send(t, dst=1), "send"),
])
def test_a_python_list_names_the_op_and_the_conversion(call, op):
    with pytest.raises(TypeError) as info:
        call([1.0, 2.0, 3.0])
    text = str(info.value)
    assert text.startswith(f"{op}:") and "Python list" in text and "jnp.asarray(" in text


def test_a_torch_tensor_names_the_op_and_the_numpy_conversion():
    torch = import_or_skip("torch", "torch is the reference here")
    t = torch.ones(8, 2)
    with pytest.raises(TypeError) as info:
        jaxpg.all_reduce(t)
    text = str(info.value)
    assert text.startswith("all_reduce: tensor is a torch.Tensor")
    assert "jnp.asarray(tensor.numpy())" in text
    # and the conversion it names works, giving torch's own sum
    out = jaxpg.all_reduce(jnp.asarray(t.numpy()))
    np.testing.assert_allclose(np.asarray(out), (t * 8).numpy())


def test_float64_follows_jaxs_x64_setting_and_never_changes_silently():
    assert not jax.config.jax_enable_x64
    data = np.linspace(0.0, 1.0, 16).reshape(8, 2)  # float64
    with pytest.warns(UserWarning, match=r"all_reduce: tensor is float64 and becomes float32"):
        out = jaxpg.all_reduce(data)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.tile(data.sum(0), (8, 1)), rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxpg.all_reduce(data.astype(np.float32)).dtype == jnp.float32  # no warning
    fits = np.arange(16, dtype=np.int64).reshape(8, 2)
    np.testing.assert_array_equal(np.asarray(jaxpg.all_reduce(fits)),
                                  np.tile(fits.sum(0), (8, 1)))
    with pytest.raises(ValueError, match=re.escape("outside int32's range")):
        jaxpg.all_reduce(np.full((8, 2), 2**40, np.int64))


def test_float64_stays_float64_with_x64_on():
    jax.config.update("jax_enable_x64", True)
    try:
        data = np.linspace(0.0, 1.0, 16).reshape(8, 2) / 3.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = jaxpg.all_reduce(data)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), np.tile(data.sum(0), (8, 1)), rtol=1e-15)
    finally:
        jax.config.update("jax_enable_x64", False)
