"""combine_fn validation: the purity probe, validate=/fscan.config, check_associative,
and the engine's promise that aliasing outputs are safe."""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import (
    add,
    affine_compose,
    assert_trees_close,
    cached_verdicts,
    linear_recurrence,
    logaddexp,
    matmul,
    maximum,
    mul,
    parametrize,
    raises,
    sequential_scan,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan._call import ScanCall
from fscan._config import Config, _env_flag
from fscan._knowledge.purity import probeable
from fscan._knowledge.store import Knowledge
from fscan._knowledge.validate import validate_combine_fn

MODES = ["pointwise", "generic"]
SCAN = "fscan.associative_scan: "
CHECK = "fscan.check_associative: "


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def snapshot(tree):
    return optree.tree_map(torch.clone, tree, none_is_leaf=False)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    """Each test starts with no cached verdict, so its first call is probed."""
    fscan.clear_caches()
    yield
    fscan.clear_caches()


# --- purity probe: in-place writes -------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_inplace_write_to_first_argument_is_an_error_and_data_survives(mode):
    xs = torch.randn(9)
    before = xs.clone()
    with raises(
        fscan.ImpureCombineError,
        SCAN + "`combine_fn` modified its first argument in place (leaf xs, with "
        "aten.add_.Tensor). combine_fn must be pure",
    ):
        fscan.associative_scan(lambda a, b: a.add_(b), xs, 0, combine_mode=mode)
    assert torch.equal(xs, before)


@pytest.mark.parametrize("mode", MODES)
def test_inplace_write_names_the_leaf_path_of_the_second_argument(mode):
    def combine(x, y):
        y[1]["h"].mul_(2.0)
        return x[0] + y[0], {"h": x[1]["h"] + y[1]["h"]}

    xs = (torch.randn(6, 2), {"h": torch.randn(6, 2)})
    before = snapshot(xs)
    with raises(
        fscan.ImpureCombineError,
        "modified its second argument in place (leaf xs[1]['h'], with aten.mul_.Tensor)",
    ):
        fscan.associative_scan(combine, xs, 0, combine_mode=mode)
    assert_trees_close(xs, before, rtol=0, atol=0)


def augmented(a, b):
    a += b
    return a


def through_a_view(a, b):
    a[..., 0] = 0.0
    return a + b


def out_argument(a, b):
    return torch.add(a, b, out=a)


@parametrize(combine=[augmented, through_a_view, out_argument], mode=MODES)
def test_every_kind_of_inplace_write_is_caught(combine, mode):
    xs = torch.randn(5, 3)
    before = xs.clone()
    with raises(fscan.ImpureCombineError, "modified its first argument in place (leaf xs, with"):
        fscan.associative_scan(combine, xs, 0, combine_mode=mode)
    assert torch.equal(xs, before)


def test_write_that_bypasses_the_dispatcher_is_caught_by_value():
    def sneaky(a, b):
        a.numpy()[...] = 7.0
        return a + b

    with raises(
        fscan.ImpureCombineError,
        SCAN + "`combine_fn` modified its first argument in place (leaf xs). combine_fn",
    ):
        fscan.associative_scan(sneaky, torch.randn(4), 0)


def test_inplace_write_to_a_fresh_temporary_is_fine():
    def combine(a, b):
        out = a + b
        out.mul_(1.0)
        return out

    xs = torch.randn(7)
    assert_trees_close(fscan.associative_scan(combine, xs, 0), torch.cumsum(xs, 0))


def test_inplace_write_is_caught_in_inference_mode():
    # Inference tensors have no version counter: the dispatch mode still sees the write.
    with torch.inference_mode(), raises(fscan.ImpureCombineError, "aten.sub_.Tensor"):
        fscan.associative_scan(lambda a, b: a.sub_(b), torch.randn(5), 0)
    with torch.inference_mode():
        out = fscan.associative_scan(add, torch.ones(5), 0)
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


# --- purity probe: randomness ------------------------------------------------------


def rand_like(a, b):
    return a + b + torch.rand_like(a)


def dropout(a, b):
    return torch.nn.functional.dropout(a + b, 0.5, training=True)


def own_generator(a, b):
    return a + b * torch.randn((), generator=torch.Generator().manual_seed(0))


@parametrize(combine=[rand_like, dropout, own_generator], mode=MODES)
def test_randomness_is_an_error_and_leaves_the_global_rng_alone(combine, mode):
    xs = torch.randn(6)
    state = torch.get_rng_state()
    with raises(fscan.ImpureCombineError, SCAN + "`combine_fn` called the random operation aten."):
        fscan.associative_scan(combine, xs, 0, combine_mode=mode)
    # The probe stops at the random op, before it draws.
    assert torch.equal(torch.get_rng_state(), state)


def test_randomness_message_names_the_op_and_the_fix():
    with pytest.raises(fscan.ImpureCombineError) as info:
        fscan.associative_scan(rand_like, torch.randn(6), 0)
    message = str(info.value)
    assert "called the random operation aten.rand_like.default. combine_fn must be" in message
    assert "Draw the random numbers beforehand and pass them in as part of `xs`." in message


def test_impure_errors_are_combine_fn_errors_and_runtime_errors():
    with pytest.raises(fscan.CombineFnError) as info:
        fscan.associative_scan(rand_like, torch.randn(3), 0)
    assert isinstance(info.value, RuntimeError)


# --- purity probe: outputs ---------------------------------------------------------


def test_wrong_output_shape_names_the_leaf_path_expected_and_got():
    xs = (torch.ones(5), {"h": torch.ones(5, 3)})
    with raises(
        fscan.CombineFnError,
        SCAN + "`combine_fn` returned a tensor of shape (3, 3) and dtype torch.float32 for "
        "leaf xs[1]['h'], expected a tensor of shape (3,) and dtype torch.float32 on cpu",
    ):
        fscan.associative_scan(
            lambda x, y: (x[0] + y[0], {"h": torch.outer(x[1]["h"], y[1]["h"])}),
            xs,
            0,
            combine_mode="generic",
        )


def last(a, b):
    return b


def first(a, b):
    return a


def first_and_last(x, y):
    """``(x0, y1)``: associative, and both outputs alias the inputs."""
    return x[0], y[1]


def storages(tree) -> set[int]:
    return {leaf.untyped_storage().data_ptr() for leaf in optree.tree_leaves(tree)}


@parametrize(
    combine=[last, first, first_and_last],
    mode=MODES,
    reverse=[False, True],
    n=[1, 2, 3, 5, 8, 33],
    grad=[False, True],
)
def test_outputs_that_alias_inputs_just_work(combine, mode, reverse, n, grad):
    """Both engines (in place, and out of place for autograd) copy into fresh outputs."""
    gen = seeded(n)
    if combine is first_and_last:
        xs = (torch.randn(n, 2, generator=gen), torch.randn(2, n, generator=gen).T)
    else:
        xs = torch.randn(3, n, generator=gen)[1]  # a strided view
    xs = optree.tree_map(lambda x: x.detach().requires_grad_(grad), xs)
    before = snapshot(xs)
    out = fscan.associative_scan(combine, xs, 0, reverse=reverse, combine_mode=mode)
    expected = sequential_scan(combine, before, 0, reverse, mode)
    assert_trees_close(out, expected, rtol=0, atol=0)
    assert_trees_close(xs, before, rtol=0, atol=0)
    assert not storages(out) & storages(xs)
    assert all(o.requires_grad == grad for o in optree.tree_leaves(out))


# --- the probe's cache -------------------------------------------------------------


class CountingAdd:
    """An ``add`` that counts its calls in a tensor: a side effect the probe does not see,
    and state that does not change its key (a counter in a Python int would: fscan keys
    what ``combine_fn`` reads by value, so every call would be a new key)."""

    def __init__(self) -> None:
        self.calls = torch.zeros((), dtype=torch.int64)

    def __call__(self, a, b):
        self.calls.add_(1)
        return a + b


def calls_of(fn: CountingAdd, **kwargs) -> int:
    before = int(fn.calls)
    fscan.associative_scan(fn, torch.randn(16), 0, **kwargs)
    return int(fn.calls) - before


# Counts the torch engine's combine_fn calls (the C++ kernel traces combine_fn instead).
@pytest.mark.torch_engine
def test_the_probe_runs_once_per_key_then_the_verdict_is_cached():
    # validate=False: the probe alone (the first-call associativity check, which makes
    # calls of its own, is counted in tests/test_associativity_warning.py).
    fn = CountingAdd()
    first_call, second_call = calls_of(fn, validate=False), calls_of(fn, validate=False)
    assert first_call == second_call + 1


def test_validate_true_probes_every_call():
    fn = CountingAdd()
    calls_of(fn)
    plain = calls_of(fn)
    assert calls_of(fn, validate=True) > plain + 1
    assert calls_of(fn, validate=True) == calls_of(fn, validate=True)


def test_fresh_lambdas_of_one_definition_share_a_verdict():
    xs = torch.randn(8)
    for _ in range(20):
        fscan.associative_scan(lambda a, b: a + b, xs, 0)
    assert cached_verdicts("pure") == 1


def test_captured_flags_are_part_of_the_key():
    def make(inplace: bool):
        return lambda a, b: a.add_(b) if inplace else a + b

    xs = torch.randn(8)
    fscan.associative_scan(make(False), xs, 0)
    with raises(fscan.ImpureCombineError, "aten.add_.Tensor"):
        fscan.associative_scan(make(True), xs, 0)


def test_dtype_and_mode_are_part_of_the_key():
    fscan.associative_scan(add, torch.randn(8), 0)
    fscan.associative_scan(add, torch.arange(8), 0)
    fscan.associative_scan(add, torch.randn(8), 0, combine_mode="generic")
    assert cached_verdicts("pure") == 3


def test_length_is_not_part_of_the_key():
    for n in range(2, 12):
        fscan.associative_scan(add, torch.randn(n, 3), 0)
    assert cached_verdicts("pure") == 1


def test_empty_scan_dim_is_not_probed():
    out = fscan.associative_scan(lambda a, b: a.add_(b), torch.ones(0, 3), 0)
    assert out.shape == (0, 3)
    assert cached_verdicts("pure") == 0


def test_probe_is_skipped_inside_vmap_and_runs_on_plain_calls():
    def under_vmap(x):
        assert not probeable([x])
        return fscan.associative_scan(add, x, 0)

    xs = torch.randn(3, 6)
    assert_trees_close(torch.func.vmap(under_vmap)(xs), torch.cumsum(xs, 1))
    assert cached_verdicts("pure") == 0


def test_probe_is_skipped_under_grad_with_a_wrapped_capture():
    x = torch.rand(7, 3, dtype=torch.float64) + 0.5
    loss = lambda s: fscan.associative_scan(lambda a, b: a * b * s, x, 0).sum()
    s = torch.rand(3, dtype=torch.float64) + 0.5
    expected = torch.func.grad(lambda s: sequential_scan(lambda a, b: a * b * s, x, 0).sum())
    torch.testing.assert_close(torch.func.grad(loss)(s), expected(s))
    assert cached_verdicts("pure") == 0


def test_checks_are_skipped_while_torch_compile_traces():
    _, spec = optree.tree_flatten(torch.ones(4))

    entry = Knowledge()

    @torch.compile(fullgraph=True, backend="eager")
    def traced(x):
        call = ScanCall("t", augmented, x, spec, [x], 0, False, "pointwise")
        validate_combine_fn(call, entry)
        validate_combine_fn(call._replace(combine_fn=torch.sub, validate=True), entry)
        return x + 1

    torch._dynamo.reset()
    assert traced(torch.ones(4)).tolist() == [2.0] * 4
    assert cached_verdicts("pure") == 0


# --- validate= and fscan.config ----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_validate_true_catches_a_non_associative_combine_fn(mode):
    xs = torch.randn(10, 4)
    with pytest.warns(fscan.NotAssociativeWarning):  # by default: a warning, once
        fscan.associative_scan(torch.sub, xs, 0, combine_mode=mode)
    with raises(fscan.NotAssociativeError, SCAN + "`combine_fn` is not associative: for leaf xs"):
        fscan.associative_scan(torch.sub, xs, 0, combine_mode=mode, validate=True)


def test_validate_true_passes_an_associative_combine_fn():
    xs = (torch.rand(50, 3), torch.randn(50, 3))
    out = fscan.associative_scan(linear_recurrence, xs, 0, validate=True)
    assert_trees_close(out, sequential_scan(linear_recurrence, xs, 0, combine_mode="pointwise"))


def test_config_validate_is_the_default_of_validate():
    xs = torch.randn(10)
    with fscan.config.override(validate=True):
        with raises(fscan.NotAssociativeError, "is not associative"):
            fscan.associative_scan(torch.sub, xs, 0)
        fscan.associative_scan(torch.sub, xs, 0, validate=False)
    assert fscan.config.validate is False
    with pytest.warns(fscan.NotAssociativeWarning):
        fscan.associative_scan(torch.sub, xs, 0)


def test_validate_must_be_a_bool_or_none():
    with raises(fscan.ScanTypeError, SCAN + "`validate` must be a bool or None, got str 'yes'."):
        fscan.associative_scan(add, torch.ones(3), 0, validate="yes")


def test_config_validate_must_be_a_bool():
    with raises(fscan.ScanTypeError, "fscan.config: `validate` must be a bool, got int 1."):
        fscan.config.validate = 1


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("true", True), ("ON", True), ("0", False)]
)
def test_environment_variable_sets_the_default(monkeypatch, raw, value):
    monkeypatch.setenv("FSCAN_VALIDATE", raw)
    assert Config().validate is value


def test_environment_variable_must_be_a_boolean(monkeypatch):
    monkeypatch.setenv("FSCAN_VALIDATE", "maybe")
    with raises(fscan.ScanValueError, "environment variable FSCAN_VALIDATE='maybe' is not a"):
        _env_flag("FSCAN_VALIDATE")


# --- check_associative: what it rejects --------------------------------------------


def mean_of_two(a, b):
    return (a + b) / 2


def mul_plus_one(a, b):
    return a * b + 1


@parametrize(
    combine=[torch.sub, mean_of_two, mul_plus_one],
    mode=MODES,
    dtype=[torch.float64, torch.float32, torch.float16, torch.bfloat16],
)
def test_rejects_operations_that_are_not_associative(combine, mode, dtype):
    xs = torch.randn(20, dtype=dtype, generator=seeded(1))
    with raises(fscan.NotAssociativeError, CHECK + "`combine_fn` is not associative: for leaf"):
        fscan.check_associative(combine, xs, combine_mode=mode)


def test_rejects_integer_subtraction_with_an_exact_message():
    # xs[i] = 3 i: a = 18 - 21 = -3, b = 12 - 15 = -3, c = 3 - 6 - 9 = -12.
    xs = torch.arange(10) * 3
    with raises(
        fscan.NotAssociativeError,
        CHECK + "`combine_fn` is not associative: for leaf xs, f(f(a, b), c) = 12 but "
        "f(a, f(b, c)) = -12; they differ by 24, with a = the combination of elements 6..7, "
        "b = the combination of elements 4..5, c = the combination of elements 1..3 along "
        "dim 0. A scan regroups combine_fn calls freely, so it needs "
        "f(f(a, b), c) == f(a, f(b, c)) for all elements.",
    ):
        fscan.check_associative(torch.sub, xs, generator=seeded(3))


def test_message_names_leaf_path_index_tolerance_and_dim():
    xs = (torch.ones(4, 6), {"h": torch.randn(4, 6, generator=seeded(0))})
    with pytest.raises(fscan.NotAssociativeError) as info:
        fscan.check_associative(
            lambda x, y: (x[0] * y[0], {"h": x[1]["h"] - y[1]["h"]}),
            xs,
            dim=1,
            combine_mode="pointwise",
        )
    message = str(info.value)
    assert "for leaf xs[1]['h'] at index (" in message
    assert "above the tolerance" in message and "along dim 1" in message
    assert "check with fscan.check_associative(..., rtol=...) and a larger rtol" in message


def test_larger_tolerance_accepts_roundoff_sized_differences():
    xs = torch.randn(30, generator=seeded(0))
    fscan.check_associative(mean_of_two, xs, rtol=10.0)
    fscan.check_associative(mean_of_two, xs, atol=100.0)


def test_rejects_bool_operation_exactly():
    implies = lambda a, b: ~a | b  # (a -> b) -> c differs from a -> (b -> c)
    with raises(fscan.NotAssociativeError, "f(f(a, b), c) = "):
        fscan.check_associative(implies, torch.rand(20, generator=seeded(0)) > 0.5)


def test_impure_combine_fn_is_reported_as_impure_not_as_non_associative():
    with raises(fscan.ImpureCombineError, CHECK + "`combine_fn` modified its first argument"):
        fscan.check_associative(lambda a, b: a.sub_(b), torch.randn(8))


# --- check_associative: what it accepts --------------------------------------------


def float_data(seed: int, dtype: torch.dtype):
    gen = seeded(seed)
    return {
        "add": (add, (torch.randn(40, 8, generator=gen) * 100).to(dtype), "pointwise"),
        "mul": (mul, (torch.rand(40, 8, generator=gen) * 2 + 0.1).to(dtype), "pointwise"),
        "max": (maximum, torch.randn(40, 8, generator=gen).to(dtype), "generic"),
        "logaddexp": (logaddexp, (torch.randn(40, 8, generator=gen) * 30).to(dtype), "pointwise"),
        "matmul": (matmul, torch.randn(40, 8, 8, generator=gen).to(dtype), "generic"),
        "affine": (
            affine_compose,
            {"w": torch.randn(40, 4, generator=gen), "c": torch.randn(40, 4, generator=gen)},
            "generic",
        ),
        "linrec": (
            linear_recurrence,
            (torch.rand(40, 8, generator=gen).to(dtype), torch.randn(40, 8, generator=gen)),
            "pointwise",
        ),
        "last": (last, torch.randn(40, 8, generator=gen).to(dtype), "pointwise"),
    }


@parametrize(dtype=[torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_accepts_associative_operations_over_many_seeds(dtype):
    for seed in range(8):
        for name, (combine, xs, mode) in float_data(seed, dtype).items():
            xs = optree.tree_map(lambda x: x.to(dtype), xs)
            for check_seed in range(3):
                try:
                    fscan.check_associative(
                        combine, xs, combine_mode=mode, generator=seeded(check_seed)
                    )
                except fscan.NotAssociativeError as err:
                    pytest.fail(f"{name} seed {seed}/{check_seed}: false alarm: {err}")


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=1, max_size=30
    ),
    op=st.sampled_from([add, maximum, logaddexp, last, first]),
    seed=st.integers(0, 2**16),
)
def test_accepts_associative_operations_on_any_data(values, op, seed):
    fscan.check_associative(op, torch.tensor(values), generator=seeded(seed))


def test_accepts_integer_wraparound_and_bool_ops_exactly():
    ints = torch.randint(-(2**62), 2**62, (30, 4), generator=seeded(0))
    fscan.check_associative(mul, ints)
    fscan.check_associative(add, ints)
    flags = torch.rand(30, 4, generator=seeded(1)) > 0.5
    for op in (torch.logical_or, torch.logical_and, torch.logical_xor):
        fscan.check_associative(op, flags)


def test_non_finite_values_are_not_false_alarms():
    xs = torch.tensor([0.0, -float("inf"), 1.0, float("nan"), -float("inf"), 2.0, 3.0])
    fscan.check_associative(logaddexp, xs)
    fscan.check_associative(maximum, xs)
    fscan.check_associative(mul, torch.tensor([1e30, 1e30, 1e-30, 0.0, 1e30]))


def test_complex_multiplication_is_accepted():
    xs = torch.randn(30, 3, dtype=torch.complex64, generator=seeded(0))
    fscan.check_associative(mul, xs, combine_mode="pointwise")


def test_empty_scan_dim_passes_quietly():
    fscan.check_associative(torch.sub, torch.ones(0, 3))


def test_deterministic_with_a_generator_and_never_touches_the_global_rng():
    xs = torch.randn(50, generator=seeded(0))

    def message(gen):
        with pytest.raises(fscan.NotAssociativeError) as info:
            fscan.check_associative(torch.sub, xs, generator=gen)
        return str(info.value)

    state = torch.get_rng_state()
    assert message(seeded(5)) == message(seeded(5))
    assert message(None) == message(None)
    assert torch.equal(torch.get_rng_state(), state)


def test_user_data_is_untouched_and_gradients_are_not_tracked():
    xs = torch.randn(20, 3, requires_grad=True)
    before = xs.detach().clone()
    fscan.check_associative(mul, xs, combine_mode="pointwise")
    assert torch.equal(xs.detach(), before) and xs.grad is None


@pytest.mark.parametrize(
    ("kwargs", "exc", "text"),
    [
        (dict(trials=0), fscan.ScanValueError, "`trials` must be at least 1, got 0."),
        (dict(trials=2.0), fscan.ScanTypeError, "`trials` must be an int, got float."),
        (dict(rtol=-1.0), fscan.ScanValueError, "`rtol` must be >= 0, got -1.0."),
        (dict(atol="0"), fscan.ScanTypeError, "`atol` must be a float or None, got str."),
        (dict(generator=0), fscan.ScanTypeError, "`generator` must be a torch.Generator or None"),
        (dict(dim=3), fscan.ScanValueError, "`dim` 3 is out of range"),
        (dict(combine_mode="fast"), fscan.ScanValueError, "`combine_mode` must be 'pointwise'"),
    ],
)
def test_bad_arguments(kwargs, exc, text):
    with raises(exc, CHECK + text):
        fscan.check_associative(add, torch.ones(4), **kwargs)


def test_a_value_dependent_write_into_the_input_is_reported():
    # The probe sees batches of at most two elements; a write that only larger batches
    # trigger is caught afterwards by the input's version counter, loudly.
    sneaky = lambda a, b: a.add_(b) if a.shape[0] > 2 else a + b
    x = torch.ones(16)
    with pytest.raises(fscan.ImpureCombineError, match="Your input has been changed"):
        fscan.associative_scan(sneaky, x, 0)


def test_validate_on_under_vmap():
    xs = torch.randn(3, 5)
    with fscan.config.override(validate=True):
        out = torch.func.vmap(lambda x: fscan.associative_scan(torch.add, x, 0))(xs)
    torch.testing.assert_close(out, xs.cumsum(1))
