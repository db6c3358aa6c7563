"""Parameter shapes must agree across ranks; the error names the parameter and the ranks."""

import jax
import optax
import pytest
from _ddp_models import MLP, group

import jaxpg.ddp.param_sync as param_sync
from jaxpg.ddp import DistributedDataParallel, verify_param_shapes
from jaxpg.internal import param_signature


def test_equal_signatures_pass():
    model = MLP(0)
    sig = param_signature({"l1": {"kernel": model.l1.kernel[...], "bias": model.l1.bias[...]}})
    assert sig == (("['l1']['bias']", tuple(model.l1.bias.shape), "float32"),
                   ("['l1']['kernel']", tuple(model.l1.kernel.shape), "float32"))
    full = param_signature(model)
    assert len(full) == len(jax.tree_util.tree_leaves(model)) > 2
    assert verify_param_shapes([full] * 4) is None  # equal everywhere: no error
    assert verify_param_shapes([full, full], ranks=[3, 6]) is None


def test_first_differing_parameter_and_ranks_are_named():
    sig = list(param_signature({"a": MLP(0).l1.kernel[...], "b": MLP(0).l2.kernel[...]}))
    other = list(sig)
    other[1] = (other[1][0], (3, 3), other[1][2])
    with pytest.raises(ValueError, match=r"parameter 1 \(\['b'\]\).*rank 0 has shape \(16, 4\)"
                                         r".*rank\(s\) \[2, 5\] have shape \(3, 3\)"):
        verify_param_shapes([sig, sig, other, sig, sig, other])


def test_missing_parameter_and_dtype_are_reported():
    sig = param_signature({"a": MLP(0).l1.kernel[...]})
    longer = sig + (("['z']", (2,), "float32"),)
    with pytest.raises(ValueError, match=r"rank 4 has no such parameter.*\[1\]"):
        verify_param_shapes([sig, longer], ranks=[4, 1])
    bf16 = ((sig[0][0], sig[0][1], "bfloat16"),)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        verify_param_shapes([sig, bf16])


def test_constructor_rejects_a_rank_with_another_shape(world, monkeypatch):
    real = param_sync.gather_param_signatures

    def one_rank_differs(params, pg):  # what all_gather_object would return across processes
        sigs = real(params, pg)
        path, shape, dtype = sigs[2][0]
        sigs[2] = ((path, (shape[0] + 1, *shape[1:]), dtype), *sigs[2][1:])
        return sigs

    monkeypatch.setattr(param_sync, "gather_param_signatures", one_rank_differs)
    with pytest.raises(ValueError, match=r"\['l1'\]\['bias'\].*rank\(s\) \[2\]"):
        DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
