"""The engines: each runs a scan of flat leaves it is handed, and none chooses another.

:mod:`fscan._routing.scan` picks among them and passes in what one needs from another
(the adjoint's reverse scan). ``tree`` is the plain-torch algorithm the others
build on; ``adjoint`` (with ``adjoint_probe``, whether it serves) is its memory-lean
backward; ``triton`` runs on CUDA/XPU, ``cpp`` on CPU; ``traced`` (with
``traced_adjoint`` and ``traced_workarounds``) is the op ``torch.compile`` and
``torch.export`` see; ``blocked`` is the drop-ins' two-level scan, whose inner scans
:mod:`fscan._routing.cumulative` passes in.
"""
