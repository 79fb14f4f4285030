"""epmoe.Layer on the CPU executor against the numpy model of the layer (epmoe_ref.py)."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from epmoe_ref import (
    NumpyLayer,
    assert_within_bf16_ulps,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    make_batch,
    make_layers,
    make_problem,
    raise_first,
    rel_l2,
    run_ranks,
)

SHAPE = dict(hidden=128, intermediate=64, num_experts=8, top_k=4, max_tokens_per_rank=16)

# Tokens per rank per round: every world has rounds where some ranks (or all) have T == 0.
TOKENS = {
    1: [[5], [0], [16], [0], [3]],
    2: [[5, 0], [0, 7], [0, 0], [16, 1], [2, 3]],
    4: [[5, 0, 0, 3], [0, 0, 0, 0], [1, 16, 0, 0], [0, 2, 9, 4], [0, 0, 0, 1]],
}
# rel-L2 against the unquantized float64 forward that each precision stays under (as `epmoe run`).
EXACT_BOUND = {"bf16": 0.02, "mxfp8": 0.10, "nvfp4": 0.35, "fp8_block128": 0.10, "mxfp4": 0.35}


def shape(**overrides):
    return epmoe.LayerShape(**{**SHAPE, **overrides})


def run_rounds(world, precision="bf16", combine="staged", swiglu_limit=0.0, ids_dtype=np.int32,
               activation="swiglu", biases=None):
    problem = make_problem(shape(), world, seed=11 * world)
    b13, b2 = biases if biases is not None else (None, None)
    layers = make_layers(problem, precision, combine=combine, swiglu_limit=swiglu_limit,
                         timeout_ms=20_000, activation=activation, b13=b13, b2=b2)
    as_f32 = (lambda b: None if b is None else (bf16_bits_to_f32(b) if b.dtype == np.uint16 else b))
    model = NumpyLayer(problem, precision, combine, swiglu_limit, activation, as_f32(b13),
                       as_f32(b2))
    for r, tokens in enumerate(TOKENS[world]):
        batches = [make_batch(problem.shape, tokens[rank], seed=1000 * r + rank)
                   for rank in range(world)]

        def step(rank):
            b = batches[rank]
            return layers[rank].forward(b.x, b.ids.astype(ids_dtype), b.weights)

        outputs = raise_first(run_ranks(world, step))
        for rank in range(world):
            y, b = outputs[rank], batches[rank]
            assert y.shape == (tokens[rank], SHAPE["hidden"]) and y.dtype == np.uint16
            differing = assert_within_bf16_ulps(y, model.forward(b))
            assert differing <= y.size // 100  # only float64 summation order differs
            if tokens[rank] > 0:
                err = rel_l2(y, model.forward_exact(b))
                assert err < EXACT_BOUND[precision], (rank, r, err)
    for layer in layers:
        assert layer.health().ok
        assert layer.next_round == len(TOKENS[world]) + 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_forward_matches_numpy_model_with_idle_ranks(world):
    run_rounds(world, "bf16")


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4", "fp8_block128", "mxfp4"])
def test_quantized_forward_matches_numpy_model(precision):
    run_rounds(2, precision)


@pytest.mark.parametrize("precision", ["fp8_block128", "mxfp4"])
def test_checkpoint_precisions_with_in_kernel_reduce_match_numpy_model(precision):
    run_rounds(4, precision, combine="in_kernel_reduce")


def test_precision_enum_names_the_checkpoint_formats():
    assert epmoe.Precision("fp8_block128") is epmoe.Precision.fp8_block128
    assert str(epmoe.Precision.mxfp4) == "mxfp4"
    config = epmoe.make_config(shape(), epmoe.Precision.fp8_block128, 0, 2)
    assert "precision=fp8_block128" in config.describe()


def test_in_kernel_reduce_matches_fp32_sum_within_one_ulp():
    run_rounds(2, "bf16", combine="in_kernel_reduce")


def test_swiglu_clamp_and_int64_ids():
    run_rounds(2, "bf16", swiglu_limit=0.5, ids_dtype=np.int64)


def random_biases(seed=5, bf16_bits=False):
    rng = np.random.default_rng(seed)
    e, h, i = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"]
    b13 = f32_to_bf16_bits(rng.uniform(-1, 1, (e, 2 * i)).astype(np.float32))
    b2 = f32_to_bf16_bits(rng.uniform(-0.5, 0.5, (e, h)).astype(np.float32))
    return (b13, b2) if bf16_bits else (bf16_bits_to_f32(b13), bf16_bits_to_f32(b2))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("combine", ["staged", "in_kernel_reduce"])
def test_swiglu_oai_with_biases_matches_the_numpy_model(precision, combine):
    run_rounds(2, precision, combine, swiglu_limit=0.75, activation="swiglu_oai",
               biases=random_biases(bf16_bits=precision == "mxfp8"))


def test_swiglu_oai_and_biases_change_the_output():
    problem = make_problem(shape(), 1, seed=3)
    batch = make_batch(problem.shape, 6, seed=4)
    b13, b2 = random_biases()

    def y(**options):
        layer = make_layers(problem, "bf16", **options)[0]
        return layer.forward(batch.x, batch.ids, batch.weights)

    base = y(activation="swiglu_oai", b13=b13, b2=b2)
    assert not np.array_equal(base, y(activation="swiglu", swiglu_limit=7.0, b13=b13, b2=b2))
    assert not np.array_equal(base, y(activation="swiglu_oai"))
    assert not np.array_equal(base, y(activation="swiglu_oai", b13=b13))


def test_swiglu_oai_defaults_its_clamp_to_7_and_refuses_0():
    config = epmoe.make_config(shape(), activation="swiglu_oai")
    assert (config.activation, config.swiglu_limit) == ("swiglu_oai", 7.0)
    assert "activation=swiglu_oai swiglu_limit=7" in config.describe()
    assert epmoe.make_config(shape()).swiglu_limit == 0.0
    assert epmoe.make_config(shape(), activation=epmoe.Activation.swiglu).activation == "swiglu"
    with pytest.raises(epmoe.Error, match="swiglu_limit=0: activation=swiglu_oai requires a clamp"):
        epmoe.make_config(shape(), activation="swiglu_oai", swiglu_limit=0.0)
    with pytest.raises(epmoe.Error, match="activation=gelu: must be one of swiglu, swiglu_oai"):
        epmoe.make_config(shape(), activation="gelu")


def test_bad_bias_is_named():
    problem = make_problem(shape(), 1, seed=3)
    b13, b2 = random_biases()
    with pytest.raises(epmoe.Error, match=r"Layer: weights.b13 has shape \[8, 64\], expected"):
        make_layers(problem, "bf16", b13=b13[:, :64])
    with pytest.raises(epmoe.Error, match="Layer: weights.b2 has dtype f64, expected bf16 or f32"):
        make_layers(problem, "bf16", b2=b2.astype(np.float64))


def test_bf16_inputs_of_every_kind_give_the_same_bits():
    """uint16 bits, ml_dtypes.bfloat16 and f32/bf16 weights; out= is written in place."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    problem = make_problem(shape(), 1, seed=3)
    b = make_batch(problem.shape, 6, seed=4)
    w13, w2 = problem.local(0)
    group = epmoe.HostGroup(1)
    comm = group.communicator(0)
    as_bf16 = lambda bits: bf16_bits_to_f32(bits).astype(ml_dtypes.bfloat16)  # noqa: E731
    layer_bits = epmoe.Layer(comm, problem.shape, epmoe.Precision.bf16, w13, w2)
    layer_f32 = epmoe.Layer(comm, problem.shape, "bf16", bf16_bits_to_f32(w13),
                            bf16_bits_to_f32(w2))
    layer_ml = epmoe.Layer(comm, problem.shape, "bf16", as_bf16(w13), as_bf16(w2))

    y_bits = layer_bits.forward(b.x, b.ids, b.weights)
    out = np.zeros((6, SHAPE["hidden"]), dtype=ml_dtypes.bfloat16)
    y_ml = layer_ml.forward(as_bf16(b.x), b.ids, b.weights, out=out)
    assert y_ml is out and y_ml.dtype == ml_dtypes.bfloat16
    y_f32 = layer_f32(b.x, b.ids, b.weights)
    np.testing.assert_array_equal(y_bits, y_ml.view(np.uint16))
    np.testing.assert_array_equal(y_bits, y_f32)
    assert_within_bf16_ulps(y_bits, NumpyLayer(problem).forward(b))


def test_forward_reads_views_without_copying():
    """A row slice of a bigger buffer (contiguous) is read in place, and out= a slice is written."""
    problem = make_problem(shape(), 1, seed=5)
    b = make_batch(problem.shape, 8, seed=6)
    layer = make_layers(problem)[0]
    big_x = np.zeros((16, SHAPE["hidden"]), np.uint16)
    big_x[4:12] = b.x
    big_y = np.full((16, SHAPE["hidden"]), 0xFFFF, np.uint16)
    y = layer.forward(big_x[4:12], b.ids, b.weights, out=big_y[2:10])
    assert np.shares_memory(y, big_y)
    assert (big_y[:2] == 0xFFFF).all() and (big_y[10:] == 0xFFFF).all()
    assert_within_bf16_ulps(big_y[2:10], NumpyLayer(problem).forward(b))


def test_torch_tensors_are_read_directly():
    """torch tensors are read through their attributes (no DLPack export): views with an offset,
    tensors that require grad, int64 ids, and torch's own rejections."""
    torch = pytest.importorskip("torch")
    problem = make_problem(shape(), 1, seed=7)
    b = make_batch(problem.shape, 5, seed=8)
    w13, w2 = problem.local(0)
    w13 = torch.nn.Parameter(torch.from_numpy(bf16_bits_to_f32(w13)), requires_grad=True)
    layer = epmoe.Layer(epmoe.HostGroup(1).communicator(0), problem.shape, "bf16", w13,
                        torch.from_numpy(w2.view(np.int16)).view(torch.bfloat16))
    x = torch.zeros(7, SHAPE["hidden"], dtype=torch.bfloat16)
    x[2:] = torch.from_numpy(bf16_bits_to_f32(b.x)).to(torch.bfloat16)
    y = layer.forward(x[2:], torch.from_numpy(b.ids).long(), torch.from_numpy(b.weights))
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (5, SHAPE["hidden"])
    bits = y.view(torch.int16).numpy().view(np.uint16)
    assert_within_bf16_ulps(bits, NumpyLayer(problem).forward(b))
    with pytest.raises(epmoe.Error, match=r"forward: x has dtype torch.float16, which epmoe"):
        layer.forward(x[2:].half(), torch.from_numpy(b.ids), torch.from_numpy(b.weights))
    with pytest.raises(epmoe.Error, match=r"forward: x is on meta, which epmoe does not take"):
        layer.forward(x[2:].to("meta"), torch.from_numpy(b.ids), torch.from_numpy(b.weights))
    with pytest.raises(epmoe.Error, match=r"forward: x has layout torch.sparse_coo"):
        layer.forward(x[2:].float().to_sparse(), torch.from_numpy(b.ids),
                      torch.from_numpy(b.weights))
    with pytest.raises(epmoe.Error, match=r"forward: x is not contiguous \(strides \[1, 5\]\)"):
        layer.forward(x[2:].t().contiguous().t(), torch.from_numpy(b.ids),
                      torch.from_numpy(b.weights))


def test_config_and_options_round_trip():
    config = epmoe.make_config(shape(), epmoe.Precision.mxfp8, 1, 4,
                               combine=epmoe.Combine.in_kernel_reduce, timeout_ms=1234,
                               swiglu_limit=7.0, mxfp8_scale_rounding="ocp_floor",
                               expert_math="exact")
    assert (config.precision, config.rank, config.world, config.local_experts) == ("mxfp8", 1, 4, 2)
    assert (config.combine, config.timeout_ms, config.swiglu_limit) == ("in_kernel_reduce", 1234, 7.0)
    assert config.mxfp8_scale_rounding == "ocp_floor" and config.shape == shape()
    assert config.expert_owner(5) == 2 and config.workspace_bytes() > 0
    assert "hidden=128" in config.describe()
    # Every knob is read by some backend (stages, which none read, left with epmoe.config/10):
    # block_m / block_n are marked where expert_math=exact runs fixed tiles, num_sms,
    # dispatch_warps, token_back and megakernel never, and no caller-owned option.
    d = config.describe()
    assert d.startswith("epmoe.config/10 ") and "stages=" not in d
    assert "(not read yet)" not in d and "token_back=epilogue_warps block_m=" in d
    assert "megakernel=false}" in d
    assert d.count(" (not read by expert_math=exact)") == 8 and "num_sms=0 " in d
    assert "(not read" not in d[:d.index(" knobs.")]
    model = epmoe.find_model("qwen3-30b-a3b")
    assert (model.hidden, model.top_k) == (2048, 8)
    assert model.layer_shape(4).max_tokens_per_rank == 4
    assert "mixtral-8x7b" in [m.name for m in epmoe.known_models()]


def test_expert_math_round_trips_through_the_config_and_the_layer():
    assert epmoe.make_config(shape()).expert_math == "wgmma"  # the default
    exact = epmoe.make_config(shape(), "bf16", 0, 1, expert_math="exact")
    tc = epmoe.make_config(shape(), "bf16", 0, 1, expert_math=epmoe.ExpertMath.tensor_core)
    assert tc.expert_math == "tensor_core"
    assert "expert_math=tensor_core" in tc.describe() and "expert_math=exact" in exact.describe()
    assert tc.describe() != exact.describe()
    with pytest.raises(epmoe.Error, match=r"expert_math=fast: must be one of exact, tensor_core"):
        epmoe.make_config(shape(), expert_math="fast")
    # The CPU executor computes exactly whatever the option: tensor_core output is the exact one.
    problem = make_problem(shape(), 1, seed=21)
    b = make_batch(problem.shape, 5, seed=22)
    group = epmoe.HostGroup(1)
    ys = []
    for math in ("exact", "tensor_core", "wgmma"):
        with epmoe.Layer(group.communicator(0), problem.shape, "bf16", *problem.local(0),
                         expert_math=math) as layer:
            assert layer.config.expert_math == math
            ys.append(layer.forward(b.x, b.ids, b.weights))
    np.testing.assert_array_equal(ys[0], ys[1])
    with pytest.raises(epmoe.Error, match=r"expert_math=TC: must be one of exact, tensor_core"):
        epmoe.Layer(group.communicator(0), problem.shape, "bf16", *problem.local(0),
                    expert_math="TC")


def test_layers_from_config_and_communicator_properties():
    problem = make_problem(shape(), 2, seed=9)
    group = epmoe.HostGroup(2)
    assert group.world == 2

    def create(rank):
        comm = group.communicator(rank)
        assert (comm.rank, comm.world, comm.backend) == (rank, 2, "cpu_threads")
        config = epmoe.make_config(problem.shape, "bf16", rank, 2, deterministic=True)
        return epmoe.Layer.from_config(comm, config, *problem.local(rank))

    layers = raise_first(run_ranks(2, create))
    assert layers[1].config.deterministic and layers[1].config.rank == 1
    b = [make_batch(problem.shape, t, seed=t) for t in (3, 0)]
    ys = raise_first(run_ranks(2, lambda r: layers[r].forward(b[r].x, b[r].ids, b[r].weights)))
    assert_within_bf16_ulps(ys[0], NumpyLayer(problem).forward(b[0]))


def test_jax_bfloat16_through_dlpack():
    """A DLPack producer with a real bfloat16 dtype (kDLBfloat), read in place; jax arrays are
    immutable, so the output is a numpy array."""
    jnp = pytest.importorskip("jax.numpy")
    problem = make_problem(shape(), 1, seed=12)
    b = make_batch(problem.shape, 7, seed=13)
    layer = make_layers(problem)[0]
    x = jnp.asarray(bf16_bits_to_f32(b.x)).astype(jnp.bfloat16)
    ids = jnp.asarray(b.ids)
    out = np.empty((7, SHAPE["hidden"]), np.uint16)
    y = layer.forward(x, ids, jnp.asarray(b.weights), out=out)
    assert y is out
    assert_within_bf16_ulps(y, NumpyLayer(problem).forward(b))
    with pytest.raises(epmoe.Error, match="forward: x has dtype f32, expected bf16"):
        layer.forward(x.astype(jnp.float32), ids, jnp.asarray(b.weights), out=out)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "nvfp4", "fp8_block128", "mxfp4"])
def test_resident_weight_bytes_of_the_cpu_executor_are_fp32_values_and_matrix_scales(precision):
    """The CPU executor holds its experts as fp32 decode(encode(w)) and one scale per matrix."""
    problem = make_problem(shape(), 2, seed=7)
    layers = make_layers(problem, precision)
    s = problem.shape
    local = s.num_experts // 2
    want = (local * 3 * s.intermediate * s.hidden + 2 * local) * 4
    assert [layer.resident_weight_bytes for layer in layers] == [want, want]
    layers[0].close()
    layers[1].close()
    with pytest.raises(epmoe.Error):
        layers[0].resident_weight_bytes
