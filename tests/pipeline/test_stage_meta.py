"""infer_stage_metadata: shapes by tracing, checked stage to stage."""

import jax
import jax.numpy as jnp
import pytest

from jaxpg.pipeline.stage.metadata import format_struct, infer_stage_metadata


def block(w, x):
    return jnp.tanh(x @ w)


def test_metadata_per_stage_with_ranks_and_chunks():
    metas = infer_stage_metadata(
        block, jnp.ones((4, 8, 8)), jnp.ones((2, 3)), num_ranks=2, num_chunks=2,
        first_fn=lambda e, x: x @ e, first_params=jnp.ones((3, 8)),
        loss_fn=lambda h, y, t: jnp.mean(y @ h - t), last_params=jnp.ones((8, 1)),
        targets=jnp.ones((2, 1)),
    )  # fmt: skip
    assert [(m.stage, m.rank, m.chunk) for m in metas] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    assert all(m.input.shape == (2, 8) and m.output.shape == (2, 8) for m in metas)


def test_output_shape_mismatch_names_both_stages():
    with pytest.raises(
        ValueError, match=r"stage 0 \(rank 0, chunk 0\) outputs float32\[2,4\].*stage 1"
    ):
        infer_stage_metadata(lambda w, x: x @ w, jnp.ones((2, 8, 4)), jnp.ones((2, 8)), num_ranks=2)


def test_dtype_mismatch_is_reported():
    with pytest.raises(ValueError, match="bfloat16"):
        infer_stage_metadata(
            lambda w, x: (x @ w).astype(jnp.bfloat16), jnp.ones((2, 8, 8)), jnp.ones((2, 8)),
            num_ranks=2,
        )  # fmt: skip


def test_embedding_output_that_stage_cannot_take():
    with pytest.raises(ValueError, match=r"stage 0 .*cannot take the output of first_fn"):
        infer_stage_metadata(
            block, jnp.ones((2, 8, 8)), jnp.ones((2, 3)), num_ranks=2,
            first_fn=lambda e, x: x @ e, first_params=jnp.ones((3, 5)),
        )  # fmt: skip


def test_loss_must_be_scalar():
    with pytest.raises(ValueError, match="scalar"):
        infer_stage_metadata(
            block, jnp.ones((2, 8, 8)), jnp.ones((2, 8)), num_ranks=2,
            loss_fn=lambda h, y, t: y, targets=jnp.ones((2,)),
        )  # fmt: skip


def test_format_struct():
    assert format_struct(jax.ShapeDtypeStruct((2, 8), jnp.float32)) == "float32[2,8]"
    assert "int32[3]" in format_struct({"a": jnp.ones((3,), jnp.int32)})
