"""One line naming the machine a table was timed on.

The kernels are built for the CPU they run on (``-march=native``), and the same row
differs by 2x and more between machines: on an AVX2 CPU the lane path's double
accumulation runs at half the vector width of AVX-512's, and a copy's bandwidth
differs too. So every table says which CPU and which vector ISA it measured.
"""

from __future__ import annotations

import os
import platform

import torch

__all__ = ["machine_line"]


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """``machine: <cpu>, <n> cores, vector ISA <isa>; torch <version>``.

    Example:
        >>> "vector ISA" in machine_line()
        True
    """
    isa = torch.backends.cpu.get_cpu_capability()
    return (
        f"machine: {_cpu_model()}, {os.cpu_count()} cores, vector ISA {isa}; "
        f"torch {torch.__version__}"
    )
