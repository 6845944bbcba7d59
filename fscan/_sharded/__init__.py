"""Scans across ranks: ``fscan.distributed`` and DTensor inputs.

``layout`` says where the pieces lie and which group holds them; ``agree`` makes
every rank check the call before an element moves; ``exchange`` moves the piece
totals (with its autograd); ``scan`` scans a sharded sequence from local scans
through :mod:`fscan._entry` (``traced``: its fold of the totals under
``torch.compile``); ``dtensor`` unwraps DTensor inputs to it, ``dtensor_ops`` runs the
drop-ins on DTensors. ``deterministic=True``: ``deterministic`` (the doors), ``block_scan``
(each rank's steps), ``blocks`` (the plan of blocks aligned to global position) and
``fixed_batch`` (combine calls of a fixed batch width).
"""
