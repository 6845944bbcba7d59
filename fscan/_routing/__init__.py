"""The router: the one place that picks an engine, for every kind of call.

``scan`` routes ``associative_scan`` and every scan that reaches the internal entry;
``cumulative`` routes the drop-ins (``fscan.cumsum`` & co.). Each has its table in
its docstring.
"""
