"""The C++ kernel stands aside while a TorchDispatchMode is active: such a mode sees aten
ops only, and the kernel's work would be hidden from it. The pointwise check is such a
mode: a scan nested in the ``combine_fn`` it watches ran on the kernel, unseen, so a
combine that scans along the batch passed the check (a 4-step scan gave another answer
than the sequential loop)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fscan
from fscan._engines.cpp import cpu_kernel

pytestmark = pytest.mark.skipif(cpu_kernel.compiler_problem() is not None, reason="no C++ compiler")


def _nested_scan(x, y):
    return x + fscan.associative_scan(lambda p, q: p * q, y, 0, reverse=True)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_a_scan_nested_in_combine_fn_is_refused_on_the_kernel_route(n):
    with fscan.config.override(cpu_kernel="eager"):
        fscan.clear_caches()
        with pytest.raises(fscan.CombineFnError, match="moves values between elements"):
            fscan.associative_scan(_nested_scan, torch.randn(n, 10, 2), 0)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_scan_s_aten_ops():
    x = torch.randn(4096, 64)
    with fscan.config.override(cpu_kernel="eager"):
        want = fscan.associative_scan(torch.add, x, 0)  # built, known elementwise
        with _Ops() as mode:
            got = fscan.associative_scan(torch.add, x, 0)
    torch.testing.assert_close(got, want)
    assert torch.ops.aten.add.Tensor in mode.seen
