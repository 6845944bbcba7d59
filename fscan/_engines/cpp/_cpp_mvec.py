"""glibc's vector math (libmvec): whether this machine has it, and its declarations.

GCC vectorises a loop calling ``exp``/``log1p``/... only where it knows a SIMD variant
of the function, which glibc declares only under ``-ffast-math``; the kernels declare
the variants themselves (:func:`mvec_declarations`) and link libmvec where :data:`MVEC`.
"""

from __future__ import annotations

import platform

__all__ = ["MVEC", "mvec_declarations"]

_GLIBC = platform.libc_ver()
_GLIBC_VERSION = (
    tuple(int(p) for p in _GLIBC[1].split(".")[:2])
    if _GLIBC[0] == "glibc" and _GLIBC[1]
    else (0, 0)
)
MVEC = platform.machine() == "x86_64" and _GLIBC_VERSION >= (2, 22)
_MVEC_222 = ["exp", "log", "sin", "cos"]
_MVEC_235 = [
    "log1p",
    "expm1",
    "exp2",
    "log2",
    "log10",
    "tanh",
    "tan",
    "sinh",
    "cosh",
    "erf",
    "atan",
    "asin",
    "acos",
]


def mvec_declarations() -> str:
    """glibc's vector math (libmvec) variants: glibc declares them only under -ffast-math."""
    if not MVEC:
        return ""
    names = _MVEC_222 + (_MVEC_235 if _GLIBC_VERSION >= (2, 35) else [])
    decls = []
    for n in names:
        decls.append(f'__attribute__((__simd__("notinbranch"))) double {n}(double) noexcept;')
        decls.append(f'__attribute__((__simd__("notinbranch"))) float {n}f(float) noexcept;')
    body = "\n".join(decls)
    return (
        "#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)"
        " && defined(__GLIBC__)\n"
        f'extern "C" {{\n{body}\n}}\n#endif\n'
    )
