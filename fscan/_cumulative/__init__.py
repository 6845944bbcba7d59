"""Empty but for a temporary re-export (``rules.KERNEL_MIN_NUMEL``) kept while
:mod:`fscan._recurrences.chunked` still imports it from here; the drop-ins' routing is
:mod:`fscan._routing.cumulative`, their blocked scan :mod:`fscan._engines.blocked`.
"""
