"""The engines: each runs a scan of flat leaves it is handed, and none chooses another.

The router (:mod:`fscan._routing`) picks among them and passes in what one needs from
another: the adjoint's reverse scan, the chunked walk's recurrence over chunk ends,
the blocked scan's inner scans. ``tree`` is the plain-torch algorithm the others
build on, ``reduce`` its tree reduction; ``adjoint`` (with ``adjoint_blocks``, the
Jacobian blocks it scans, and ``adjoint_probe``, whether it serves) is its
memory-lean backward; ``triton`` runs on CUDA/XPU, ``cpp`` on CPU; ``blocked`` holds
the drop-ins' blocked and extremum scans, ``chunked`` the linear recurrences'
chunked walk and loop, ``matrix_tree`` the matrix recurrence's tree; ``traced``
(with ``traced_adjoint`` and ``traced_workarounds``) is the op ``torch.compile`` and
``torch.export`` see, and ``hop`` torch's ``associative_scan`` op as ``traced`` and
``triton`` call it.
"""
