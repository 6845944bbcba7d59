"""The linear recurrences' machinery behind the public recurrence functions.

``args`` checks their arguments; ``solve`` runs one (and holds the adjoint's
gradient formulas); ``chunked`` is the chunked walk and the tree over chunk
totals; ``composed_gates`` says when composing gates is exact.
"""
