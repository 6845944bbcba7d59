"""The router: the one place that picks an engine, for every kind of call.

``scan`` routes ``associative_scan`` and every scan that reaches the internal entry;
``recurrence`` routes the linear recurrences (elementwise, log space, matrix). Each
has its table in its docstring.
"""
