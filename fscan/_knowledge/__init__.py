"""What fscan knows about a ``combine_fn``, and the one home of every store that outlives a call.

``reach`` walks its closure (``reach_keys`` turns what it finds into cache keys);
``store`` keeps one entry per key, of which ``fscan.clear_caches()`` forgets all;
``purity``, ``pointwise_check`` and ``associativity`` are the probes whose verdicts
the entries hold; ``validate`` runs the checks ``validate=`` asks for.
"""
