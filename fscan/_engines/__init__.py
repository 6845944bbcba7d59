"""The engines: each runs a scan of flat leaves it is handed, and none chooses another.

:mod:`fscan._routing.scan` picks among them and passes in what one needs from another
(the adjoint's reverse scan). ``tree`` is the plain-torch algorithm the others
build on; ``adjoint`` (with ``adjoint_blocks``, the Jacobian blocks it scans, and
``adjoint_probe``, whether it serves) is its memory-lean backward; ``triton`` runs on
CUDA/XPU, ``cpp`` on CPU; ``traced`` (with ``traced_adjoint`` and
``traced_workarounds``) is the op ``torch.compile`` and ``torch.export`` see. ``hop``
is torch's ``associative_scan`` op as ``traced`` and ``triton`` call it.
"""
