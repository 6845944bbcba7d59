"""Every script in ``examples/`` runs to its end: each asserts its own results.

Each runs as a user would run it, ``python examples/NAME.py`` in a fresh
process from the repository root, and must exit 0 after printing ``ok``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py"))
# Each takes a few seconds on 2 cores; the limit only stops a hung one.
TIMEOUT_S = 300


def test_there_are_examples():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_checks_itself(name):
    run = subprocess.run(
        [sys.executable, f"examples/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, f"examples/{name} failed:\n{run.stdout}\n{run.stderr}"
    assert run.stdout.splitlines()[-1] == "ok", run.stdout
    # Their combine_fns are associative: the first-call check must stay quiet.
    assert "NotAssociativeWarning" not in run.stderr, run.stderr
