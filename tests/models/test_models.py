"""jaxpg.models without Hugging Face: the presets' published sizes, a laid-out model's
logits against the same weights on one device (FSDP x CP x TP with sequence parallelism),
the positions rules under cp, the kv-heads rule of the tp plan, and pipeline stages."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpg
from jaxpg import models

TOKENS = np.random.default_rng(1).integers(0, 64, (4, 16))


@pytest.mark.parametrize("name,total,active", [
    ("llama3-8b", 8.03e9, None), ("llama3-70b", 70.55e9, None), ("llama3-405b", 405.85e9, None),
    ("qwen3-0.6b", 0.596e9, None), ("qwen3-8b", 8.19e9, None),
    ("qwen3-30b-a3b", 30.53e9, 3.35e9), ("qwen3-235b-a22b", 235.09e9, 22.19e9)])
def test_presets_hold_the_published_sizes(name, total, active):
    config = models.config_for(name)
    assert abs(config.num_params() - total) / total < 2e-3
    if active is not None:
        assert abs(config.active_params() - active) / active < 2e-3


def test_fsdp_cp_tp_with_sequence_parallelism_gives_the_one_device_logits():
    config = models.config_for("llama3-tiny")
    want = np.asarray(models.CausalLM(config, rngs=nnx.Rngs(3))(TOKENS))
    model = models.CausalLM(config, rngs=nnx.Rngs(3))
    layout = models.parallelize(model, jaxpg.ParallelDims(dp_shard=2, cp=2, tp=2),
                                sequence_parallel=True)
    # q_proj: column-parallel over tp and FSDP-split over dp_shard x cp on its input dim;
    # o_proj: row-parallel, FSDP-split on its output dim (the rows of the HF weight)
    assert layout.spec("layers.0.self_attn.q_proj.kernel") == P(("dp_shard", "cp"), "tp")
    assert layout.spec("layers.0.self_attn.o_proj.kernel") == P("tp", ("dp_shard", "cp"))
    np.testing.assert_allclose(np.asarray(model(TOKENS)), want, rtol=0, atol=1e-5)
    # fsdp=False: the tp split only, for a data-parallel wrapper that shards the rest
    plain = models.CausalLM(config, rngs=nnx.Rngs(3))
    unsharded = models.parallelize(plain, jaxpg.ParallelDims(dp_shard=2, cp=2, tp=2),
                                   fsdp=False, place=False)
    assert unsharded.spec("layers.0.self_attn.q_proj.kernel") == P(None, "tp")
    assert unsharded.fsdp_dims == ()


def _laid_out(config, **degrees):
    model = models.CausalLM(config, rngs=nnx.Rngs(0))
    dims = jaxpg.ParallelDims(**degrees)
    models.parallelize(model, dims)
    return model, dims


def test_a_cp_model_refuses_local_positions_and_naming_the_fix():
    model, dims = _laid_out(models.config_for("qwen3-tiny"), dp_shard=4, cp=2)
    graphdef, state = nnx.split(model)
    specs = jax.tree.map(lambda a: a.sharding.spec, state)

    def per_rank(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens)  # no positions

    run = jaxpg.spmd(per_rank, mesh=dims, in_specs=(specs, P("dp_shard", "cp")),
                     out_specs=P("dp_shard", "cp"))
    with pytest.raises(ValueError, match=r"context parallelism \(cp=2\).*pass positions="):
        jax.jit(run)(state, np.zeros((4, 16), np.int32))


def test_a_model_laid_out_without_cp_refuses_to_run_over_a_cp_axis():
    model = models.CausalLM(models.config_for("llama3-tiny"), rngs=nnx.Rngs(0))
    dims = jaxpg.ParallelDims(dp_shard=4, cp=2)
    graphdef, state = nnx.split(model)

    def per_rank(state, tokens, positions):
        return nnx.merge(graphdef, state).forward(tokens, positions)

    run = jaxpg.spmd(per_rank, mesh=dims, in_specs=(P(), P(None, "cp"), P(None, "cp")),
                     out_specs=P(None, "cp"))
    tokens = np.zeros((2, 16), np.int32)
    with pytest.raises(ValueError, match=r"laid out without context parallelism.*'cp' "
                                         r"axis has size 2.*cp=2"):
        jax.jit(run)(state, tokens, tokens)


def test_layout_errors_name_the_fix():
    config = models.config_for("llama3-tiny")  # 2 kv heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_kv_heads=2.*\[1, 2\]"):
        _laid_out(config, dp_shard=2, tp=4)
    with pytest.raises(ValueError, match="sequence_parallel=True is for dense models"):
        models.tp_plan(models.config_for("qwen3-moe-tiny"), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"ep=4 must equal cp=2 or dp_shard x cp=8"):
        _laid_out(models.config_for("qwen3-moe-tiny"), dp_shard=4, cp=2, ep=4)
    with pytest.raises(ValueError, match="no preset 'llama4'"):
        models.config_for("llama4")
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        models.config_for("llama3-tiny", num_kv_heads=3)
    moe_model = models.CausalLM(models.config_for("qwen3-moe-tiny"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe_model)
    run = jaxpg.spmd(lambda s, t: nnx.merge(graphdef, s).forward(t),
                     mesh=jaxpg.ParallelDims(dp_shard=8), in_specs=(P(), P("dp_shard")),
                     out_specs=P("dp_shard"))
    with pytest.raises(ValueError, match=r"not laid out.*jaxpg.models.parallelize"):
        jax.jit(run)(state, np.zeros((8, 4), np.int32))


def test_pipeline_stages_chain_to_the_model_and_bounds_balance_the_edges():
    config = models.config_for("llama3-8b")
    assert models.stage_bounds(config, 4) == [0, 8, 16, 24, 32]
    assert models.stage_bounds(config, 4, edge_cost=2) == [0, 7, 16, 25, 32]
    tiny = models.config_for("llama3-tiny", num_layers=3)
    model = models.CausalLM(tiny, rngs=nnx.Rngs(0))
    stages = models.pipeline_stages(model, bounds=[0, 1, 3])
    positions = np.broadcast_to(np.arange(16), TOKENS.shape)

    @jax.jit
    def both(state, tokens):
        m = nnx.merge(*state)
        parts = models.pipeline_stages(m, bounds=[0, 1, 3])
        out = (tokens, positions)
        for stage in parts:  # each but the last gives the next one's (h, positions)
            out = stage(*out)
        return out, m.forward(tokens, positions)

    chained, whole = both(nnx.split(model), TOKENS)
    np.testing.assert_allclose(np.asarray(chained), np.asarray(whole), rtol=0, atol=1e-6)
    assert [len(s.layers) for s in stages] == [1, 2]
    with pytest.raises(ValueError, match="ties its head to the embedding"):
        models.pipeline_stages(models.CausalLM(models.config_for("qwen3-tiny"),
                                               rngs=nnx.Rngs(0)), 2)


def test_a_laid_out_model_trains_under_fsdp_with_cp_as_on_one_device():
    # parallelize(fsdp=False) keeps the tp split and the cp attention; FullyShardedDataParallel
    # shards the rest over dp_shard x cp and splits the batch's sequences over cp, the
    # positions leaf with the tokens (global positions travel with the batch). Two SGD steps
    # on the whole batch equal one-device SGD.
    import optax

    from jaxpg.fsdp import FullyShardedDataParallel

    config = models.config_for("llama3-tiny")
    window = np.random.default_rng(2).integers(0, 64, (8, 17)).astype(np.int32)
    batch = {"tokens": window[:, :-1], "targets": window[:, 1:],
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)).copy()}

    def loss_fn(model, b):
        logits = model(b["tokens"], b["positions"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    optimizer = optax.sgd(0.5)
    graph, params = nnx.split(models.CausalLM(config, rngs=nnx.Rngs(4)))
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graph, p), batch))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    want = []
    for _ in range(2):
        params, state, loss = step(params, state)
        want.append(float(loss))
    dims = jaxpg.ParallelDims(dp_shard=2, cp=2, tp=2)
    model = models.CausalLM(config, rngs=nnx.Rngs(4))
    models.parallelize(model, dims, fsdp=False)
    fsdp = FullyShardedDataParallel(model, optimizer, group=dims.get_group("dp_shard_cp"),
                                    context_parallel=dims["cp"])
    got = [float(fsdp.train_step(loss_fn, batch)["loss"]) for _ in range(2)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert want[1] < want[0] - 1e-3  # the step changed the weights


def test_to_hf_and_from_hf_round_trip_in_bfloat16_and_refuse_what_they_lack(tmp_path):
    # no transformers needed: a sharded Qwen3-MoE (experts over ep) written as one bfloat16
    # file (no index) and read back onto another layout gives the same weights, rounded
    import json

    import jax.numpy as jnp
    import ml_dtypes

    config = models.config_for("qwen3-moe-tiny")
    model = models.CausalLM(config, rngs=nnx.Rngs(5))
    want = {k: np.asarray(v.get_value()) for k, v in models.layout.param_paths(model).items()}
    models.parallelize(model, jaxpg.ParallelDims(dp_shard=4, tp=2, ep=4))
    files = models.to_hf(model, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    assert files == ["model.safetensors"]
    assert not (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    back = models.from_hf(str(tmp_path / "bf16"), dims=jaxpg.ParallelDims(dp_shard=2, cp=2, tp=2),
                          dtype=jnp.bfloat16)
    assert back.config == config
    for path, var in models.layout.param_paths(back).items():
        value = var.get_value()
        assert value.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(value),
                                      want[path].astype(ml_dtypes.bfloat16), err_msg=path)
    hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["torch_dtype"] == "bfloat16"
    for change, message in ((dict(model_type="mistral"), "model_type='mistral' is not one of"),
                            (dict(rope_scaling={"rope_type": "yarn"}), "RoPE type 'yarn'"),
                            (dict(hidden_act="gelu"), "hidden_act='gelu'"),
                            (dict(num_hidden_layers=3), "has no tensor 'model.layers.2")):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**hf, **change}))
        (tmp_path / "bad" / "model.safetensors").write_bytes(
            (tmp_path / "bf16" / "model.safetensors").read_bytes())
        with pytest.raises((ValueError, KeyError), match=message):
            models.from_hf(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        models.from_hf(str(tmp_path / "nothing"))
