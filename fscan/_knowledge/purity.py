"""The purity probe: call ``combine_fn`` once on copies of real elements and watch it.

A scan calls ``combine_fn`` on many groupings of elements, and (in
``"pointwise"`` mode) on views of the user's own tensors, so it must be pure.
The probe runs it on fresh copies of two sample operands, in the form the mode
uses (``"pointwise"``: small batches with the scan dimension first;
``"generic"``: single elements), under a dispatch mode that stops it

* at a random operation (``torch.Tag.nondeterministic_seeded``: ``torch.rand``,
  dropout, ...) before it draws, so the user's random stream is untouched;
* at an in-place write to an operand (``a.add_(b)``, ``a += b``, ``out=a``, a
  write through a view), before it writes.

Catching both at the operation itself names the op, puts the user's line in the
traceback, and is thread-safe where comparing the global RNG state before and
after is not (another thread may draw meanwhile). After the call, version
counters and values are compared too, for writes that bypass the dispatcher
(through ``.numpy()``), and the output is checked against the operands with
:func:`fscan._combine.check_combine_output`.

The verdict is stored in the call's :class:`~fscan._knowledge.store.Knowledge` entry
(keyed on ``combine_fn``'s code and everything it reaches, the pytree
structure, the mode and each leaf's metadata), so later calls pay one lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from optree import PyTreeSpec
from torch.utils._python_dispatch import TorchDispatchMode

from .._call import ScanCall
from .._combine import check_combine_output
from .._context import in_functorch_transform
from .._errors import ImpureCombineError
from .._pytree import unflatten
from .store import Knowledge

__all__ = [
    "ensure_pure",
    "probe_purity",
    "probeable",
    "run_higher_order",
    "sample_operands",
]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def ensure_pure(call: ScanCall, entry: Knowledge) -> None:
    """Probe ``call.combine_fn`` unless it passed before with the same key (see module doc).

    Nothing is probed, nor cached, for an empty scan dimension or for leaves that
    are not plain tensors with data (fake, meta, or wrapped by a ``torch.func``
    transform): the probe runs on the next plain call instead.

    Example:
        >>> import optree
        >>> from fscan._knowledge.store import Knowledge
        >>> xs, inplace = torch.ones(3), lambda a, b: a.mul_(b)
        >>> args = (xs, optree.tree_structure(xs), [xs], 0, False, "pointwise")
        >>> try:
        ...     ensure_pure(ScanCall("demo", inplace, *args), Knowledge())
        ... except ImpureCombineError as err:
        ...     print(str(err)[:88])
        demo: `combine_fn` modified its first argument in place (leaf xs, with aten.mul_.Tensor)
    """
    if entry.pure:
        return
    if call.leaves[0].shape[call.dim] == 0 or not probeable(call.leaves):
        return
    probe_purity(call)
    entry.pure = True


def probe_purity(
    call: ScanCall,
) -> None:
    """Call ``call.combine_fn`` once on copies of sample operands; raise if it is impure.

    Raises :class:`ImpureCombineError` for a random op or an in-place write to an
    operand, :class:`CombineFnError` for an output of the wrong structure, shape,
    dtype or device. Never touches ``leaves``.
    """
    api, combine_fn, _, spec, leaves, dim, _, combine_mode = call[:8]
    a, b = sample_operands(leaves, dim, combine_mode)
    operands = a + b
    pristine = [t.clone() for t in operands]
    versions = [_version(t) for t in operands]
    with torch.no_grad(), _PurityWatch(api, spec, operands):
        out = combine_fn(unflatten(spec, a), unflatten(spec, b))
    for i, (now, before, version) in enumerate(zip(operands, pristine, versions)):
        if _version(now) != version or not _same_bits(now, before):
            raise ImpureCombineError(_mutation_message(api, spec, i, len(a), op=None))
    check_combine_output(api, out, spec, a, combine_mode)


def sample_operands(
    leaves: Sequence[torch.Tensor], dim: int, combine_mode: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fresh copies of the first two operands ``combine_fn`` would see in ``combine_mode``.

    ``"generic"``: elements 0 and 1 (slices with ``dim`` removed). ``"pointwise"``:
    batches of up to two elements, the scan dimension moved first. With a single
    element both operands are copies of it.

    Example:
        >>> a, b = sample_operands([torch.arange(8.0).reshape(2, 4)], 1, "pointwise")
        >>> a[0]
        tensor([[0., 4.],
                [1., 5.]])
    """
    n = leaves[0].shape[dim]
    if combine_mode == "generic":
        second = min(1, n - 1)
        pick: Callable[[torch.Tensor, int], torch.Tensor] = lambda x, i: x.select(dim, i)
    else:
        size = max(1, min(2, n // 2))
        second = size if n >= 2 else 0
        pick = lambda x, i: x.narrow(dim, i, size).movedim(dim, 0)
    fresh = lambda x, i: pick(x, i).detach().clone(memory_format=torch.contiguous_format)
    return [fresh(x, 0) for x in leaves], [fresh(x, second) for x in leaves]


class _PurityWatch(TorchDispatchMode):
    """Raise at the first random op, or at the first op that writes into an operand."""

    # torch.cond, map & co. come here too, and are run watched (run_higher_order).
    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # A frame Dynamo first meets under a non-infra mode is skipped for good: a
        # torch.cond in combine_fn (whose eager front end compiles a wrapper) would then
        # fail on every later call under vmap, and a torch.compile'd function called in
        # combine_fn would run eagerly ever after. Compiled code still runs its ops
        # through this mode, except those a backend fuses into kernels (Inductor).
        return True

    def __init__(self, api: str, spec: PyTreeSpec, operands: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.api, self.spec, self.half = api, spec, len(operands) // 2
        self.owner = {_storage_id(t): i for i, t in enumerate(operands) if _storage_id(t)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            # One whose body cannot be watched runs as it is: the version and value
            # comparison after the call still catches writes to the operands.
            return run_higher_order(self, func, args, kwargs, unwatched=func)
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise ImpureCombineError(_random_message(self.api, func))
        if func._schema.is_mutable:
            for tensor in _written_tensors(func, args, kwargs):
                i = self.owner.get(_storage_id(tensor))
                if i is not None:
                    raise ImpureCombineError(
                        _mutation_message(self.api, self.spec, i, self.half, op=func)
                    )
        return func(*args, **kwargs)


def run_higher_order(
    mode: TorchDispatchMode,
    op: torch._ops.HigherOrderOperator,
    args: tuple,
    kwargs: dict,
    unwatched: Callable[..., Any],
) -> Any:
    """Run the higher-order op ``op`` (``torch.cond``, ``map``, ...) with ``mode`` watching
    the aten ops of its bodies; ``unwatched(*args, **kwargs)`` where that cannot be done.

    A dispatch mode sees a higher-order op as one call. Its dense (eager) kernel
    runs here with ``mode`` re-entered, so every op it runs, its bodies' included,
    reaches the mode like an op of ``combine_fn`` itself (``map``'s slicing of its
    inputs too). ``cond``'s kernel refuses to run under a mode and only picks a
    branch: there the bodies, passed to it as callables, run with ``mode`` re-entered.

    Example:
        >>> class Names(TorchDispatchMode):
        ...     supports_higher_order_operators = True
        ...     seen = []
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         if isinstance(func, torch._ops.HigherOrderOperator):
        ...             return run_higher_order(self, func, args, kwargs or {}, func)
        ...         self.seen.append(func._opname)
        ...         return func(*args, **(kwargs or {}))
        >>> pred, x = torch.tensor(True), torch.ones(1)
        >>> with Names():
        ...     _ = torch.cond(pred, torch.sin, torch.cos, (x,))
        >>> Names.seen
        ['sin']
    """
    dense = op.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
    if dense is None:
        return unwatched(*args, **kwargs)
    if op.name() not in _MODE_REFUSING_KERNELS:
        with mode:
            return dense(*args, **kwargs)

    def watched(body: Callable[..., Any]) -> Callable[..., Any]:
        def run(*body_args: Any, **body_kwargs: Any) -> Any:
            with mode:
                return body(*body_args, **body_kwargs)

        return run

    args = tuple(watched(a) if callable(a) and not isinstance(a, torch.Tensor) else a for a in args)
    return dense(*args, **kwargs)


# Higher-order ops whose dense kernel asserts that no dispatch mode is active.
_MODE_REFUSING_KERNELS = frozenset({"cond"})


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors ``func`` writes into, from its schema's alias annotations (``Tensor(a!)``)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _storage_id(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, shared by all its views; 0 for an empty storage
    or a tensor without one (a wrapper subclass), which then matches no operand."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return 0
    return storage.data_ptr() if storage.nbytes() else 0


def _version(t: torch.Tensor) -> int | None:
    # Inference tensors have no version counter; the value comparison still runs.
    return None if t.is_inference() else t._version


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality, so that NaNs compare equal to themselves."""
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def probeable(leaves: Sequence[torch.Tensor]) -> bool:
    """Plain tensors with data, outside ``torch.func`` transforms (whose wrappers, in the
    leaves or in what ``combine_fn`` closes over, hide storages, versions and values)."""
    if in_functorch_transform():
        return False
    for x in leaves:
        if (
            type(x) not in _PLAIN_TYPES
            or x.is_meta  # not device.type: a torch.device costs ~0.3 us per leaf
            or torch._C._functorch.is_functorch_wrapped_tensor(x)
            # torch.autograd.grad(is_grads_batched=True), jacobian(vectorize=True): the
            # old vmap's batched cotangents have no storage either
            or torch._C._functorch.is_legacy_batchedtensor(x)
        ):
            return False
    return True


def _operand_name(spec: PyTreeSpec, i: int, half: int) -> tuple[str, str]:
    which = "first" if i < half else "second"
    return which, spec.accessors()[i % half].codify("xs")


def _mutation_message(api: str, spec: PyTreeSpec, i: int, half: int, op: Any) -> str:
    which, path = _operand_name(spec, i, half)
    how = f", with {op}" if op is not None else ""
    return (
        f"{api}: `combine_fn` modified its {which} argument in place (leaf {path}{how}). "
        "combine_fn must be pure, since the scan passes it views of your tensors and of "
        "partial results: return new tensors instead (`a + b`, not `a.add_(b)` or `a += b`)."
    )


def _random_message(api: str, op: Any) -> str:
    return (
        f"{api}: `combine_fn` called the random operation {op}. combine_fn must be "
        "deterministic: the scan calls it on different groupings of elements, so random "
        "draws would not match any sequential result. Draw the random numbers beforehand "
        "and pass them in as part of `xs`."
    )
