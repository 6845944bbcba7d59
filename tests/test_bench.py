"""The benchmark harness (fscan.bench._timing, _rows, bars, __main__) and
scripts/bench_compare.py, on cheap workloads. Timings are never asserted: what is
checked is who gets called, when, with which settings, and what gets printed."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch

import fscan
from fscan._route_log import ENGINES
from fscan.bench import _rows, _timing, bars
from fscan.bench.__main__ import main as bench_main

ROOT = Path(__file__).resolve().parent.parent


def test_measure_is_torchs_timer_on_the_threads_asked_after_a_warm_up():
    seen: list[int] = []
    record = lambda: seen.append(torch.get_num_threads())
    before = _timing.warm_up_seconds[0]
    m = _timing.measure(record, budget_s=0.01, threads=1, description="noop")
    assert isinstance(m, torch.utils.benchmark.Measurement)
    assert m.task_spec.num_threads == 1 and m.task_spec.description == "noop"
    assert len(seen) > 2 and set(seen[1:]) == {1}  # the warm-up runs outside the Timer
    assert _timing.warm_up_seconds[0] >= before


def test_a_call_slower_than_the_budget_is_timed_once_per_turn():
    calls: list[str] = []
    slow = lambda: calls.append("slow") or time.sleep(0.02)
    fast = lambda: calls.append("fast")
    times = _timing.interleaved({"slow": slow, "fast": fast}, budget_s=0.006, rounds=3)
    assert calls[:2] == ["slow", "fast"]  # both warmed up before any timing
    assert calls.count("slow") == 1 + 3  # warm-up, then one call per turn
    assert len(times["slow"].times) == 3 and times["slow"].median >= 0.02
    turns = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
    assert turns == ["slow", "fast"] * 4  # the warm-ups, then the runners take turns


def test_engine_of_names_the_route_logs_engine_and_restores_the_logger():
    logger = logging.getLogger("fscan")
    state = (logger.level, logger.propagate, list(logger.handlers))
    x = torch.randn(16)
    with fscan.config.override(cpu_kernel="off"):
        assert _timing.engine_of(lambda: fscan.associative_scan(torch.add, x, 0)) == "tree"
    assert _timing.engine_of(lambda: torch.cumsum(x, 0)) == "torch"
    assert _timing.engine_of(lambda: None, none="-") == "-"
    assert (logger.level, logger.propagate, list(logger.handlers)) == state


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_overwrites_on_a_terminal_and_writes_lines_otherwise():
    plain, tty = io.StringIO(), _Terminal()
    for stream in (plain, tty):
        progress = _timing.Progress("table", 2, stream=stream)
        progress.step("row a")
        progress.step("row b")
        progress.close()
    assert [line.split(" (")[0] for line in plain.getvalue().splitlines()] == [
        "table: [1/2] row a",
        "table: [2/2] row b",
    ]
    assert "\n" not in tty.getvalue() and tty.getvalue().count("\r") == 3


def test_rows_are_built_in_eager_mode_before_any_timing_and_rendered(tmp_path, capsys):
    log: list[tuple[str, str]] = []
    run = lambda name: lambda: log.append((name, fscan.config.cpu_kernel))
    rows = [
        _rows.Row("group one", f"row {i}", run(f"fscan {i}"), "copy", run(f"base {i}"), 1, bar)
        for i, bar in enumerate([1e9, 1e-9])
    ]
    with fscan.config.override(cpu_kernel="on"):
        results = _rows.run_rows(rows, budget_s=0.002, title="t")
    assert log[:2] == [("fscan 0", "eager"), ("fscan 1", "eager")]  # builds come first
    assert {mode for _, mode in log} == {"eager"}
    assert "took" in capsys.readouterr().out
    assert [(r.label, r.engine, r.threads) for r in results] == [
        ("row 0", "torch", 1),
        ("row 1", "torch", 1),
    ]
    text = _rows.render(results)
    assert text.startswith("group one") and "<=1e+09 ok" in text and "OVER" in text
    torch_table = _rows.compare(results)  # torch's Compare of the same measurements
    assert "group one" in torch_table and "row 1" in torch_table and "baseline" in torch_table
    _rows.to_json(results, str(tmp_path / "rows.json"))
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data[0]["ratio"] == pytest.approx(results[0].fscan_s / results[0].base_s)


def test_a_row_is_warmed_and_named_on_its_own_thread_count():
    """The drop-ins' route table reads torch's thread count: a 1-thread row's first call
    and its engine's name happen on 1 thread, as its timing does, and the count is put
    back after."""
    seen: list[int] = []
    before = torch.get_num_threads()
    rows = [
        _rows.Row(
            "g", f"{n} threads", lambda: seen.append(torch.get_num_threads()), "b", lambda: None, n
        )
        for n in (1, 2)
    ]
    _rows.run_rows(rows, budget_s=0.002, title="t")
    assert seen[:4] == [1, 2, 1, 2]  # the first calls, then the calls that name the engine
    assert torch.get_num_threads() == before


def test_a_fresh_output_limit_is_timed_and_shown_beside_the_judged_ratio(tmp_path):
    calls: list[str] = []
    row = _rows.Row(
        "big",
        "r",
        lambda: calls.append("fscan"),
        "copy",
        lambda: None,
        1,
        1e9,
        fresh=lambda: calls.append("clone"),
    )
    plain = _rows.Row("small", "s", lambda: None, "copy", lambda: None, 1, 1e9)
    results = _rows.run_rows([row, plain], budget_s=0.002)
    assert "clone" in calls and results[0].fresh_s is not None and results[1].fresh_s is None
    assert results[0].fresh_ratio == pytest.approx(results[0].fscan_s / results[0].fresh_s)
    big, small = _rows.render(results).split("\n\n")
    assert "vs clone" in big and "not judged" in big and "<=1e+09 ok" in big
    assert "vs clone" not in small
    _rows.to_json(results, str(tmp_path / "rows.json"))
    assert json.loads((tmp_path / "rows.json").read_text())[0]["fresh_s"] == results[0].fresh_s


def test_a_bar_on_the_time_over_the_baseline_is_judged_on_the_difference(tmp_path):
    """A compiled call's overhead bar (+<= 30 us over the eager call) judges fscan_s -
    base_s, not the ratio: a row 40 us over a 10 us call is OVER at a ratio of 5."""
    slow = lambda: time.sleep(0)
    row = _rows.Row("g", "over", slow, "eager", slow, more_bar_s=30e-6)
    (result,) = _rows.run_rows([row], budget_s=0.002)
    assert result.more_bar_s == 30e-6
    over = _rows.Result("g", "over", 1, "cpp", 50e-6, "eager", 10e-6, None, more_bar_s=30e-6)
    under = _rows.Result("g", "under", 1, "cpp", 35e-6, "eager", 10e-6, None, more_bar_s=30e-6)
    plain = _rows.Result("h", "ratio", 1, "cpp", 35e-6, "eager", 10e-6, 4.0)
    over_text, plain_text = _rows.render([over, under, plain]).split("\n\n")
    assert "+<=30 us OVER" in over_text and "+<=30 us ok" in over_text
    assert "the most time over the baseline" in over_text
    assert "<=4 ok" in plain_text and "+<=" not in plain_text
    _rows.to_json([over], str(tmp_path / "rows.json"))
    assert json.loads((tmp_path / "rows.json").read_text())[0]["more_bar_s"] == 30e-6
    assert next(r for r in bars.compile_rows() if "(64,)" in r.label).more_bar_s == 30e-6


def test_only_rows_with_outputs_of_32_mib_or_more_get_the_clone_limit():
    fresh = {r.label.split(" dim")[0] for r in bars.kernel_rows(False, 1) if r.fresh is not None}
    assert {label.split(" ", 1)[1] for label in fresh} == {"(16384, 1024)"}
    assert bars._clone_of(torch.empty(4096, 256)) is None


def test_rows_keep_cpu_kernel_off_when_it_is_off():
    modes: list[str] = []
    row = _rows.Row("g", "r", lambda: modes.append(fscan.config.cpu_kernel), "b", lambda: None)
    with fscan.config.override(cpu_kernel="off"):
        _rows.run_rows([row], budget_s=0.002)
    assert set(modes) == {"off"}


def test_every_quick_bar_row_runs_and_names_an_engine_of_fscans_set():
    rows = bars.bar_rows(quick=True)
    groups = {r.group for r in rows}
    assert len(groups) == 5 and all(r.threads == 1 for r in rows)
    with fscan.config.override(cpu_kernel="off"):
        for row in rows:
            if "1048576" in row.label:  # the torch engine takes seconds there: shapes aside
                continue
            row.base()
            row.run()  # the first call, as run_rows makes it before naming engines
            engine = _rows._engine(row).split()[0]
            assert engine in ENGINES, (row.label, engine)


def test_kernel_rows_cover_every_dim_and_direction():
    labels = [
        r.label for r in bars.kernel_rows(quick=False, threads=1) if "(1024, 8, 64)" in r.label
    ]
    assert len(labels) == 5 * 3 * 2
    assert "affine (1024, 8, 64) dim 1 (middle) reverse" in labels
    two = list(bars.kernel_rows(quick=False, threads=2))
    assert {r.threads for r in two} == {2} and not any("(4096, 256)" in r.label for r in two)


def test_bench_main_writes_the_bar_rows_as_json(tmp_path, monkeypatch, capsys):
    row = _rows.Row("only", "r", lambda: None, "b", lambda: None, 1, 2.0)
    monkeypatch.setattr(bars, "bar_rows", lambda quick: [row])
    import fscan.bench.__main__ as bench

    monkeypatch.setattr(
        bench, "_tables", lambda quick, path: [("speed bars", bench._bar_rows(quick, path))]
    )
    bench_main(["--quick", "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())[0]["label"] == "r"
    out = capsys.readouterr().out
    assert "cpu_kernel='eager'" in out and "(speed bars:" in out


def _compare_script():
    spec = importlib.util.spec_from_file_location(
        "bench_compare", ROOT / "scripts/bench_compare.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_compare_overlays_this_harness_and_reports_ratios(tmp_path):
    compare = _compare_script()
    old = tmp_path / "old" / "fscan"
    (old / "bench").mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "bench" / "stale.py").write_text("")
    root = compare.overlay(tmp_path / "old", tmp_path / "side")
    assert (root / "fscan" / "__init__.py").exists()
    assert (root / "fscan" / "bench" / "bars.py").exists()
    assert not (root / "fscan" / "bench" / "stale.py").exists()
    row = lambda ratio, engine: {
        "group": "g",
        "label": "add",
        "base_name": "copy",
        "threads": 1,
        "ratio": ratio,
        "engine": engine,
    }
    before = compare.merge([[row(4.0, "tree")], [row(2.0, "tree")]])
    after = compare.merge([[row(1.5, "cpp")]])
    text = compare.report(before, after)
    assert "add (/ copy, 1t)" in text and "tree" in text and "cpp" in text
    assert text.splitlines()[-1].split()[-3:] == ["3.00", "1.50", "0.50"]
    with pytest.raises(SystemExit, match="no fscan"):
        compare.overlay(tmp_path / "nowhere", tmp_path / "side2")
