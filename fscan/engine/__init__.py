"""fscan's compiled engines.

* :mod:`fscan.engine.cpu_kernel`: a C++ scan kernel generated from a pointwise
  ``combine_fn`` for CPU (its face; the modules behind it are listed in its
  docstring; the fixed C++ is in ``csrc/``).

The torch engine (``fscan._generic``), the traced op for ``torch.compile``
(``fscan._traced``) and the Triton kernel on CUDA/XPU (``fscan._compiled``)
live next to the front end.
"""
