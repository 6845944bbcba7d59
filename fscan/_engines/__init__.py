"""The engines: each runs a scan of flat leaves it is handed, and none chooses another.

:mod:`fscan._routing.scan` picks among them and passes in what one needs from another
(the adjoint's reverse scan); :mod:`fscan._routing.recurrence` picks for the
linear recurrences among ``chunked`` (their chunked walk and loop), ``matrix_tree``
(the matrix recurrence's tree), ``cpp`` and the tree scan, and passes the chunked
walk the recurrence over chunk ends. ``tree`` is the plain-torch algorithm the others
build on; ``adjoint`` (with ``adjoint_probe``, whether it serves) is its memory-lean
backward; ``triton`` runs on CUDA/XPU, ``cpp`` on CPU; ``traced`` (with
``traced_adjoint`` and ``traced_workarounds``) is the op ``torch.compile`` and
``torch.export`` see.
"""
