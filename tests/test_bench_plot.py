"""The chart drawing of ``python -m fscan.bench --plot`` (fscan.bench.plot), on made-up numbers.

The measurements are the benchmark tables' own functions; timings are never
asserted. Skipped without matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import pytest

from fscan.bench import plot
from fscan.bench.__main__ import main


@pytest.fixture(autouse=True)
def matplotlib():
    return pytest.importorskip("matplotlib")


def test_line_chart_writes_a_png_skipping_missing_points(tmp_path):
    series = {"fscan pointwise": [1e-3, 2e-3, 4e-3], "jax.jit": [None, None, None]}
    path = plot.line_chart(
        tmp_path / "sub" / "chart.png", "demo", "time (ms)", [64, 128, 256], series, scale=1e3
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_option_writes_every_chart(tmp_path, monkeypatch, capsys):
    fake = lambda *args, **kwargs: {"fscan pointwise": [1e-3, 2e-3], "python loop": [1.0, None]}
    monkeypatch.setattr(plot, "measure_forward", fake)
    monkeypatch.setattr(plot, "measure_fwd_bwd", fake)
    monkeypatch.setattr(plot, "measure_memory", fake)
    main(["--plot", str(tmp_path), "--quick"])
    names = ["time_add.png", "time_linrec.png", "time_fwd_bwd.png", "memory_fwd_bwd.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, "bench_data.json"])
    assert capsys.readouterr().out.split() == [
        str(tmp_path / n) for n in [*names, "bench_data.json"]
    ]
