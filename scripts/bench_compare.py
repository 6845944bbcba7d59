"""Before/after ratios of the speed-bar rows: this checkout's harness run on two checkouts.

Usage::

    python scripts/bench_compare.py BEFORE [AFTER] [--quick] [--group TEXT] [--rounds N]

``BEFORE`` and ``AFTER`` are checkout roots (folders holding ``fscan/``); ``AFTER``
defaults to this checkout. Each side's ``fscan`` package is copied into a temporary
folder with *this* checkout's ``fscan/bench`` laid over it, so both sides are timed
by the same harness and the same rows (``fscan.bench.bars``, which uses only public
fscan API). The sides run in alternating fresh processes, ``--rounds`` times each
(load drifting over the run then falls on both alike); each row's ratio (fscan / its
baseline, measured in the same process) is the median over the rounds. Printed per
row: the engine and ratio before and after, and after / before (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def overlay(checkout: Path, into: Path) -> Path:
    """``checkout``'s fscan with this checkout's benchmark harness, under ``into``."""
    package = checkout / "fscan"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"bench_compare: {checkout} holds no fscan/__init__.py")
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(package, into / "fscan", ignore=ignore)
    shutil.rmtree(into / "fscan" / "bench", ignore_errors=True)
    shutil.copytree(HERE / "fscan" / "bench", into / "fscan" / "bench", ignore=ignore)
    return into


def run_side(root: Path, out: Path, options: list[str]) -> list[dict]:
    """One fresh process of ``python -m fscan.bench.bars`` on the overlay at ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "fscan.bench.bars", "--json", str(out), *options]
    subprocess.run(command, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def merge(rounds: list[list[dict]]) -> dict[tuple[str, str, str, int], dict]:
    """Per row (group, label, baseline, threads): the median ratio and the engines seen."""
    rows: dict[tuple[str, str, str, int], dict] = {}
    for results in rounds:
        for r in results:
            key = (r["group"], r["label"], r["base_name"], r["threads"])
            row = rows.setdefault(key, {"ratios": [], "engines": []})
            row["ratios"].append(r["ratio"])
            if r["engine"] not in row["engines"]:
                row["engines"].append(r["engine"])
    return {k: {**v, "ratio": statistics.median(v["ratios"])} for k, v in rows.items()}


def report(before: dict, after: dict) -> str:
    lines = []
    header = ("row", "engine before", "engine after", "before", "after", "after/before")
    body = []
    for key in [*before, *(k for k in after if k not in before)]:
        group, label, base, threads = key
        b, a = before.get(key), after.get(key)
        cells = [
            f"{label} (/ {base}, {threads}t)",
            "/".join(b["engines"]) if b else "-",
            "/".join(a["engines"]) if a else "-",
            f"{b['ratio']:.2f}" if b else "-",
            f"{a['ratio']:.2f}" if a else "-",
            f"{a['ratio'] / b['ratio']:.2f}" if a and b else "-",
        ]
        body.append((group, cells))
    widths = [max(len(c) for c in col) for col in zip(header, *(c for _, c in body))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
    group = None
    for row_group, cells in body:
        if row_group != group:
            group = row_group
            lines += ["", group, line(header)]
        lines.append(line(cells))
    return "\n".join(lines).lstrip("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the older checkout's root")
    parser.add_argument("after", type=Path, nargs="?", default=HERE, help="default: this one")
    parser.add_argument("--quick", action="store_true", help="the short subset of rows")
    parser.add_argument("--group", default="", help="only tables whose title contains this")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (alternating)")
    args = parser.parse_args(argv)
    options = ["--quick"] * args.quick + ["--group", args.group]
    with tempfile.TemporaryDirectory() as scratch:
        roots = {}
        for side in ("before", "after"):
            roots[side] = overlay(getattr(args, side).resolve(), Path(scratch) / side)
        runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
        for i in range(args.rounds):
            for side in ("before", "after"):
                print(f"round {i + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
                runs[side].append(run_side(roots[side], Path(scratch) / f"{side}.json", options))
    print(report(merge(runs["before"]), merge(runs["after"])))


if __name__ == "__main__":
    main()
