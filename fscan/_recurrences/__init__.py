"""The linear recurrences' entry, below their public functions and above the router.

``args`` checks their arguments and shapes the operands; ``solve`` (plain) and
``log_solve`` (log space) say what each recurrence is to the router
(:mod:`fscan._routing.recurrence`: the walk's operations, the tree of pairs through
the internal entry, the autograd Function) and hold the adjoint's gradient
formulas; ``matrix`` is the matrix recurrence's checks and layout;
``composed_gates`` says when composing gates is exact and walks the carries where
it is not.
"""
