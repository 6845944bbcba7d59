"""fscan's compiled engines.

* :mod:`fscan.engine.cpu_kernel`: a C++ scan kernel generated from a pointwise
  ``combine_fn`` for CPU (trace: :mod:`._cpp_codegen`, source:
  :mod:`._cpp_source`, build: :mod:`._cpp_build`).

The torch engine (``fscan._generic``), the traced op for ``torch.compile``
(``fscan._traced``) and the Triton kernel on CUDA/XPU (``fscan._compiled``)
live next to the front end.
"""
