"""``fscan.lax``: JAX-compatible front ends (``jax.lax`` names, arguments and semantics).

Example:
    >>> import torch
    >>> from fscan import lax
    >>> lax.associative_scan(torch.mul, torch.arange(1.0, 5.0), axis=-1)
    tensor([ 1.,  2.,  6., 24.])
"""

from ._lax import associative_scan as associative_scan

__all__ = ["associative_scan"]
