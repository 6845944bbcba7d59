"""Every bad input to fscan.associative_scan fails with a message that names it."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from helpers import add, raises

import fscan


def test_combine_fn_not_callable():
    with raises(fscan.ScanTypeError, "`combine_fn` must be callable, got int"):
        fscan.associative_scan(3, torch.ones(3), 0)


def test_unknown_combine_mode():
    with raises(
        fscan.ScanValueError, "`combine_mode` must be 'pointwise' or 'generic', got 'fast'"
    ):
        fscan.associative_scan(add, torch.ones(3), 0, combine_mode="fast")


def test_reverse_not_bool():
    with raises(fscan.ScanTypeError, "`reverse` must be a bool, got int 1"):
        fscan.associative_scan(add, torch.ones(3), 0, reverse=1)


@pytest.mark.parametrize("dim", [2, -3])
def test_dim_out_of_range(dim):
    with raises(
        fscan.ScanValueError,
        f"`dim` {dim} is out of range for leaf xs with 2 dimension(s), expected a value in [-2, 1]",
    ):
        fscan.associative_scan(add, torch.ones(3, 4), dim)


def test_dim_not_int():
    with raises(fscan.ScanTypeError, "`dim` must be an int, got float 0.0"):
        fscan.associative_scan(add, torch.ones(3), 0.0)


def test_zero_dim_leaf():
    with raises(fscan.ScanValueError, "leaf xs['b'] is 0-dimensional"):
        fscan.associative_scan(add, {"a": torch.ones(3), "b": torch.tensor(1.0)}, 0)


def test_different_lengths_name_both_leaves():
    xs = (torch.ones(7), {"h": torch.ones(5)})
    with raises(
        fscan.ScanValueError, "leaf xs[1]['h'] has length 5 along dim 0, expected 7 like xs[0]"
    ):
        fscan.associative_scan(add, xs, 0)


def test_leaf_without_scan_dim():
    with raises(fscan.ScanValueError, "leaf xs[1] has shape (3,) with no dimension 1"):
        fscan.associative_scan(add, (torch.ones(2, 3), torch.ones(3)), 1)


def test_non_tensor_leaf():
    with raises(fscan.ScanTypeError, "leaf xs[1] is a float 2.0, expected a torch.Tensor"):
        fscan.associative_scan(add, (torch.ones(3), 2.0), 0)


def test_sparse_leaf():
    with raises(fscan.ScanTypeError, "leaf xs has layout torch.sparse_coo, expected a dense"):
        fscan.associative_scan(add, torch.eye(3).to_sparse(), 0)


def _unscannable(kind):
    # Quantized, nested and CSR tensors warn on creation (deprecated, prototype, beta), once.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return {
            "quantized": lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.quint8),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(8), torch.ones(8)]),
            "sparse_coo": lambda: torch.randn(8).to_sparse(),
            "sparse_csr": lambda: torch.randn(8, 8).to_sparse_csr(),
        }[kind]()


UNSCANNABLE = {
    "quantized": "is a quantized tensor (dtype torch.quint8), which fscan cannot scan: torch's "
    "arithmetic does not run on quantized values; dequantize it first with .dequantize()",
    "sparse_coo": "has layout torch.sparse_coo, expected a dense (strided) tensor; convert it "
    "with .to_dense()",
    "sparse_csr": "has layout torch.sparse_csr, expected a dense (strided) tensor; convert it "
    "with .to_dense()",
    "nested": "is a nested tensor, which fscan cannot scan; scan each component (`.unbind()`) "
    "or pad it",
}
_X = torch.randn(8)
# The other operands: the odd tensor is refused before any shape is compared.
_like = lambda t: torch.randn(8)
_steps = lambda t: torch.randn(3, 8)
# Every public entry point, with the odd tensor in the named place.
ENTRY_POINTS = {
    "scan": ("associative_scan: leaf xs", lambda t: fscan.associative_scan(add, t, 0)),
    "later leaf": (
        "associative_scan: leaf xs[1]",
        lambda t: fscan.associative_scan(lambda a, b: b, (_X, t), 0),
    ),
    "generic": (
        "associative_scan: leaf xs",
        lambda t: fscan.associative_scan(add, t, 0, combine_mode="generic"),
    ),
    "initial": (
        "associative_scan: leaf initial",
        lambda t: fscan.associative_scan(add, _steps(t), 0, initial=t),
    ),
    "reduce": ("associative_reduce: leaf xs", lambda t: fscan.associative_reduce(add, t, 0)),
    "lax": ("lax.associative_scan: leaf xs", lambda t: fscan.lax.associative_scan(add, t)),
    "check": ("check_associative: leaf xs", lambda t: fscan.check_associative(add, t)),
    "cumsum": ("cumsum: `input`", lambda t: fscan.cumsum(t, 0)),
    "cumsum reverse": ("cumsum: `input`", lambda t: fscan.cumsum(t, 0, reverse=True)),
    "cumprod": ("cumprod: `input`", lambda t: fscan.cumprod(t, 0)),
    "cummax": ("cummax: `input`", lambda t: fscan.cummax(t, 0)),
    "cummin": ("cummin: `input`", lambda t: fscan.cummin(t, 0, reverse=True)),
    "logcumsumexp": ("logcumsumexp: `input`", lambda t: fscan.logcumsumexp(t, 0)),
    "linear b": ("linear_recurrence: `b`", lambda t: fscan.linear_recurrence(0.5, t, 0)),
    "linear a": ("linear_recurrence: `a`", lambda t: fscan.linear_recurrence(t, _like(t), 0)),
    "linear initial": (
        "linear_recurrence: `initial`",
        lambda t: fscan.linear_recurrence(0.5, _steps(t), 0, initial=t),
    ),
    "log b": ("log_linear_recurrence: `log_b`", lambda t: fscan.log_linear_recurrence(-1, t, 0)),
    "log a": (
        "log_linear_recurrence: `log_a`",
        lambda t: fscan.log_linear_recurrence(t, _like(t), 0),
    ),
    "matrix": (
        "linear_recurrence_matrix: `b`",
        lambda t: fscan.linear_recurrence_matrix(torch.randn(8, 8, 8), t, 0),
    ),
}


@pytest.mark.parametrize("where", list(ENTRY_POINTS))
@pytest.mark.parametrize("kind", list(UNSCANNABLE))
def test_tensors_fscan_cannot_scan_are_refused_by_name(kind, where):
    prefix, call = ENTRY_POINTS[where]
    t = _unscannable(kind)
    with raises(fscan.ScanTypeError, f"fscan.{prefix} {UNSCANNABLE[kind]}"):
        call(t)


@pytest.mark.parametrize(
    "api", ["associative_scan", "linear_recurrence", "linear_recurrence_matrix"]
)
def test_a_sparse_reset_is_refused_by_name(api):
    reset = torch.zeros(8, dtype=torch.bool).to_sparse()
    calls = {
        "associative_scan": lambda: fscan.associative_scan(add, _X, 0, reset=reset),
        "linear_recurrence": lambda: fscan.linear_recurrence(0.5, _X, 0, reset=reset),
        "linear_recurrence_matrix": lambda: fscan.linear_recurrence_matrix(
            torch.randn(8, 2, 2), torch.randn(8, 2), 0, reset=reset
        ),
    }
    with raises(fscan.ScanTypeError, f"fscan.{api}: `reset` {UNSCANNABLE['sparse_coo']}"):
        calls[api]()


META = torch.randn(8, device="meta")


@pytest.mark.parametrize(
    "call",
    [
        lambda t: fscan.associative_scan(add, t, 0),
        lambda t: fscan.associative_scan(torch.mul, t, 0, reverse=True, combine_mode="generic"),
        lambda t: fscan.associative_reduce(add, t.unsqueeze(1), 0),
        lambda t: fscan.cumsum(t, 0),
        lambda t: fscan.cummax(t, 0, reverse=True).values,
        lambda t: fscan.linear_recurrence(0.5, t, 0),
        lambda t: fscan.log_linear_recurrence(t, t, 0),
    ],
)
def test_meta_tensors_scan_to_shapes(call):
    # No values, but shapes propagate: a scan of meta tensors is a shape computation.
    out = call(META)
    assert out.is_meta and out.dtype == META.dtype


def test_check_associative_refuses_meta_tensors():
    with raises(fscan.ScanValueError, "leaf xs is a meta tensor, which holds no values to compare"):
        fscan.check_associative(add, META)


@pytest.mark.parametrize("reverse", [False, True])
def test_complex_leaves_scan(reverse):
    z = torch.randn(9, 3, dtype=torch.complex128)
    expected = torch.cumprod(z.flip(0), 0).flip(0) if reverse else torch.cumprod(z, 0)
    torch.testing.assert_close(fscan.associative_scan(torch.mul, z, 0, reverse=reverse), expected)
    torch.testing.assert_close(fscan.cumprod(z, 0, reverse=reverse), expected)
    torch.testing.assert_close(fscan.associative_reduce(torch.mul, z, 0), torch.prod(z, 0))


def test_empty_tree():
    with raises(fscan.ScanValueError, "`xs` has no tensor leaves"):
        fscan.associative_scan(add, (), 0)


def test_leaves_on_different_devices():
    xs = (torch.ones(3), torch.ones(3, device="meta"))
    with raises(fscan.ScanValueError, "leaf xs[1] is on meta, expected cpu like xs[0]"):
        fscan.associative_scan(add, xs, 0)


@pytest.mark.parametrize("mode", ["pointwise", "generic"])
def test_combine_returns_wrong_structure(mode):
    with raises(fscan.CombineFnError, "`combine_fn` returned a pytree of structure PyTreeSpec(*)"):
        fscan.associative_scan(
            lambda a, b: a[0] + b[0], (torch.ones(9), torch.ones(9)), 0, combine_mode=mode
        )


def test_combine_returns_wrong_shape_generic():
    xs = {"h": torch.ones(9, 3)}
    with raises(
        fscan.CombineFnError,
        "returned a tensor of shape () and dtype torch.float32 for leaf xs['h'], expected a "
        "tensor of shape (3,)",
    ):
        fscan.associative_scan(
            lambda a, b: {"h": (a["h"] + b["h"]).sum()}, xs, 0, combine_mode="generic"
        )


def test_combine_returns_wrong_dtype_pointwise():
    xs = (torch.ones(9), torch.ones(9, dtype=torch.int64))
    with raises(
        fscan.CombineFnError,
        # The purity probe's batch of two elements is the first call to see it.
        "returned a tensor of shape (2,) and dtype torch.float32 for leaf xs[1], expected a "
        "tensor of shape (2,) and dtype torch.int64",
    ):
        fscan.associative_scan(lambda a, b: (a[0] + b[0], a[1] + 0.5), xs, 0)


def test_combine_returns_non_tensor():
    with raises(fscan.CombineFnError, "returned a float 1.0 for leaf xs"):
        fscan.associative_scan(lambda a, b: 1.0, torch.ones(4), 0)


def test_errors_are_builtin_types_too():
    assert issubclass(fscan.ScanTypeError, TypeError)
    assert issubclass(fscan.ScanValueError, ValueError)
    assert issubclass(fscan.CombineFnError, fscan.ScanError)
    assert issubclass(fscan.UnsupportedScanError, NotImplementedError)


def test_hierarchy_groups_every_complaint_about_combine_fn():
    assert issubclass(fscan.NotAssociativeError, fscan.CombineFnError)
    assert issubclass(fscan.ImpureCombineError, fscan.CombineFnError)
    assert issubclass(fscan.ImpureCombineError, RuntimeError)
    assert issubclass(fscan.CombineFnError, ValueError)


def test_every_exception_is_public_documented_and_a_scan_error():
    for name in fscan._errors.__all__:
        cls = getattr(fscan, name)
        assert name in fscan.__all__
        base = fscan.ScanWarning if issubclass(cls, Warning) else fscan.ScanError
        assert issubclass(cls, base) and cls.__doc__, name


def test_every_raise_in_fscan_uses_the_hierarchy():
    """A static check: each `raise SomeClass(...)` in the library names an fscan error.

    Re-raising a caught exception (`raise`, `raise err`) is fine; the command-line
    entry point may exit with SystemExit.
    """
    # Uncacheable is the reach walk's internal signal: reach() catches it (the call then
    # runs uncached) and no user ever sees it.
    allowed = set(fscan._errors.__all__) | {"Uncacheable"}
    package = pathlib.Path(fscan.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if name[:1].isupper() and name not in allowed:
                offenders.append(f"{path.name}:{node.lineno} raises {name}")
    assert not offenders, offenders


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused():
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])
    with pytest.raises(fscan.ScanTypeError, match="nested tensor"):
        fscan.associative_scan(torch.add, nested, 0)


def test_python_control_flow_in_generic_mode_names_the_fix():
    branchy = lambda a, b: a if a[0] >= b[0] else b
    with raises(fscan.CombineFnError, "torch.where"):
        fscan.associative_scan(branchy, torch.randn(8, 2), 0, combine_mode="generic")
