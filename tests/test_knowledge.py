"""fscan._knowledge.store: one walk over what a combine_fn reaches gives its key and its tensors."""

from __future__ import annotations

import enum
import functools
import gc
import weakref

import pytest
import torch
from helpers import add, cached_verdicts

import fscan
from fscan._knowledge.store import leaf_signature, reach


@pytest.fixture(autouse=True)
def fresh_caches():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


def make_scaled(k):
    return lambda a, b: a + b * k


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def test_same_code_and_values_share_a_key():
    assert reach(make_scaled(2)).key == reach(make_scaled(2)).key
    assert reach(make_scaled(torch.ones(3))).key == reach(make_scaled(torch.zeros(3))).key


@pytest.mark.parametrize(
    "values",
    [(0, 1), (1.0, 2.5), ("x", "y"), (True, False), (Color.RED, Color.BLUE), (None, 0)],
    ids=["int", "float", "str", "bool", "enum", "none-vs-int"],
)
def test_captured_scalars_are_keyed_by_value(values):
    first, second = (reach(make_scaled(v)).key for v in values)
    assert first != second


def test_captured_tensors_are_keyed_by_metadata_and_requires_grad():
    keys = {
        reach(make_scaled(t)).key
        for t in (
            torch.ones(3),
            torch.ones(3, 3),
            torch.ones(3, dtype=torch.float64),
            torch.ones(3, requires_grad=True),
        )
    }
    assert len(keys) == 4


W = torch.ones(2)


def test_referenced_globals_are_part_of_the_key(monkeypatch):
    fn = lambda a, b: a + b * W
    before = reach(fn)
    assert [t is W for t in before.tensors] == [True]
    monkeypatch.setattr(__import__(__name__), "W", torch.ones(2, requires_grad=True))
    assert reach(fn).key != before.key


def test_class_and_object_attributes_named_by_the_code_are_reached():
    class H:
        w = torch.tensor(2.0)

    class Config:
        def __init__(self) -> None:
            self.scale = 1.0

    cfg = Config()
    fn = lambda a, b: a * b * H.w * cfg.scale
    first = reach(fn)
    assert [t is H.w for t in first.tensors] == [True]
    cfg.scale = 2.0
    assert reach(fn).key != first.key
    H.w = torch.tensor(2.0, requires_grad=True)
    assert [t is H.w for t in reach(fn).tensors] == [True]


def test_modules_partials_methods_and_builtins():
    linear = torch.nn.Linear(2, 2)
    found = reach(lambda a, b: a + linear(b))
    assert {id(t) for t in found.tensors} == {id(p) for p in linear.parameters()}
    linear.eval()
    assert reach(lambda a, b: a + linear(b)).key != found.key

    class Op:
        def combine(self, a, b):
            return a + b

    assert reach(Op().combine).key == reach(Op().combine).key
    assert (
        reach(functools.partial(torch.add, alpha=2)).key
        != reach(functools.partial(torch.add, alpha=3)).key
    )
    assert reach(torch.add).key != reach(torch.sub).key
    bound = torch.ones(2, requires_grad=True)
    assert [t is bound for t in reach(bound.add).tensors] == [True]


def test_keys_hold_no_reference_to_functions_captures_or_bound_tensors():
    def keys_and_refs():
        w = torch.ones(3)
        fn, bound, module = make_scaled(w), torch.ones(3).add, torch.nn.Identity()
        keys = [reach(fn).key, reach(bound).key, reach(module).key]
        return keys, [weakref.ref(o) for o in (w, fn, bound.__self__, module)]

    keys, refs = keys_and_refs()
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert len({hash(k) for k in keys}) == 3  # still usable after their objects died


def test_recursive_and_unbound_closures_terminate():
    def outer():
        def recurse(a, b):
            return recurse if a is None else a + b

        return recurse

    def unbound():
        f = lambda a, b: g(a, b)  # `g` is bound only after f is created
        key = reach(f).key
        g = add
        return key

    assert reach(outer()).key == reach(outer()).key
    assert unbound() == unbound()


class Slotted:
    __slots__ = ("w",)

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


def test_what_cannot_be_keyed_is_never_cached():
    # An object whose state fscan cannot read: verdicts are recomputed every call.
    opaque = Slotted(torch.ones(()))
    fn = lambda a, b: a + b * opaque.w
    assert reach(fn).key is None
    for _ in range(3):
        fscan.associative_scan(fn, torch.randn(8), 0)
    assert cached_verdicts("pure") == 0


def test_leaf_signature_covers_requires_grad_but_not_sizes():
    assert leaf_signature([torch.ones(4, 2)]) == leaf_signature([torch.zeros(9, 7)])
    assert leaf_signature([torch.ones(4)]) != leaf_signature([torch.ones(4, requires_grad=True)])


def test_clear_caches_forgets_every_verdict():
    fscan.associative_scan(add, torch.randn(8), 0)
    assert cached_verdicts("pure") == 1
    fscan.clear_caches()
    assert cached_verdicts("pure") == 0


def _two_cells(v, u):
    return lambda a, b: a + b + v * u  # associative: out[i] = x[0] + ... + x[i] + i * v * u


def test_a_tensor_in_two_cells_is_reached_once_and_their_aliasing_is_kept():
    w, other = torch.tensor(0.5), torch.tensor(0.25)
    shared, apart = reach(_two_cells(w, w)), reach(_two_cells(w, other))
    assert [t is w for t in shared.tensors] == [True] and shared.aliases == (0, 0)
    assert {id(t) for t in apart.tensors} == {id(w), id(other)} and apart.aliases == (0, 1)
    assert shared.key == apart.key  # same kinds: the aliasing keys what depends on it


@pytest.mark.parametrize("mode", ["off", "eager"])
def test_a_tensor_in_two_cells_gets_its_gradient_once(mode):
    # Reached from two cells, it was an input of the adjoint's autograd Function twice,
    # and its gradient came out doubled.
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    x = torch.rand(6, dtype=torch.float64, requires_grad=True)
    with fscan.config.override(cpu_kernel=mode):
        for _ in range(2):  # the second call finds the verdicts cached
            out = fscan.associative_scan(_two_cells(w, w), x, 0)
            (got,) = torch.autograd.grad(out.sum(), [w])
            assert got.item() == pytest.approx(2 * 0.5 * sum(range(6)))
