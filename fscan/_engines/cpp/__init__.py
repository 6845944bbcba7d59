"""The generated C++ CPU kernel: its face is :mod:`fscan._engines.cpp.cpu_kernel` (the
modules behind it are listed in its docstring; the fixed C++ is in ``csrc/``)."""
