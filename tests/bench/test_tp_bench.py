"""bench/tp_bench.py's report on hand-made run files: the TP = 2 over TP = 1 ratios, the mode ratios and
their differences, the targets, and the plot."""
from __future__ import annotations

import json
from pathlib import Path

from bench import tp_bench


def write_run(folder: Path, tp: int, mode: str, modes: dict[str, float], step_ms: float | None = None) -> None:
    data = {"tp": tp, "reduction": "gather_sum", "engine_mode": mode, "startup_s": 1.0, "graphs": "decode",
            "fingerprint": {"tensor_parallel_size": tp}, "environment": {},
            "modes": {name: {"output_tok_per_s": value} for name, value in modes.items()}}
    if step_ms is not None:
        data["batch1"] = {"decode_step_ms": step_ms}
    (folder / f"tp-bench-tp{tp}-{mode}.json").write_text(json.dumps(data))


def test_report_joins_the_runs(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for tp, scale, step in ((1, 1.0, 6.0), (2, 1.7, 3.6)):
        write_run(runs, tp, "nondeterministic", {"nondeterministic": 1000 * scale}, step)
        write_run(runs, tp, "dvr", {"dvr_10pct": 950 * scale, "dvr_100pct": (700 if tp == 1 else 690) * scale})
        write_run(runs, tp, "batch_invariant", {"batch_invariant": 600 * scale})
    assert tp_bench.main(["report", str(runs), "--out", str(tmp_path), "--name", "r"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert abs(report["throughput_ratio_tp2_over_tp1"] - 1.7) < 1e-9
    assert abs(report["decode_step_ratio_tp2_over_tp1"] - 0.6) < 1e-9
    delta = report["mode_ratio_delta_tp2_minus_tp1"]
    assert abs(delta["dvr_100pct"] + 0.01) < 1e-9 and abs(delta["dvr_10pct"]) < 1e-9
    assert report["targets_met"] == {"throughput": True, "decode_step": True, "mode_ratios": True}
    assert (tmp_path / "r.png").stat().st_size > 0
