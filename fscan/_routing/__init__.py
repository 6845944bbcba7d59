"""The router: the one place that picks an engine, for every kind of call.

One module per kind of call, each with its table in its docstring: ``scan`` routes
``associative_scan`` and every scan that reaches the internal entry; ``recurrence``
routes the linear recurrences (elementwise, log space, matrix); ``cumulative`` routes
the drop-ins (``fscan.cumsum`` & co.); ``reduce`` routes ``associative_reduce``.
``reasons`` reads the scan's route without side effects, with why each faster
engine was passed over (``fscan.explain``). ``repeat`` (the scan's) and
``repeat_drop_ins`` answer a call identical to one the C++ kernel served, under the key
of ``repeat_key``, before the checks.
"""
