"""bench/profiling/report.py folds both stack formats per process: py-spy's raw output, whose process frames
name the process, and the sampler's one file per process with its header."""
from __future__ import annotations

import gzip
from pathlib import Path

from bench.profiling.report import fold, report


def test_folds_py_spy_and_sampler_stacks_by_process(tmp_path: Path) -> None:
    spy = tmp_path / "serve-profile.txt"
    spy.write_text('process 10:"serve";main (a.py:1);step (b.py:7) 5\n'
                   'process 10:"serve";process 11:"-c";loop (c.py:3);delta (c.py:9) 2\n'
                   'process 10:"serve";main (a.py:2);step (b.py:8) 1\n')
    sampled = tmp_path / "42.txt"
    sampled.write_text("# pid 42 ppid 1 process MainProcess period_s 0.005 argv bench\nrun (d.py:1);work (d.py:5) 3\n")
    stacks = fold([spy, sampled])
    packed = tmp_path / "serve-profile.txt.gz"
    packed.write_bytes(gzip.compress(spy.read_bytes()))
    assert fold([packed]) == {k: v for k, v in stacks.items() if k.startswith("process")}
    assert stacks["process 10"] == {("main (a.py)", "step (b.py)"): 6}
    assert stacks["process 11"] == {("loop (c.py)", "delta (c.py)"): 2}
    [(name, counts)] = [(k, v) for k, v in stacks.items() if k.startswith("42.txt")]
    assert "pid 42" in name and counts == {("run (d.py)", "work (d.py)"): 3}
    text = report(stacks, 5)
    assert text.index("process 10: 6 samples") < text.index("process 11: 2 samples")
    assert "100.0 %  step (b.py)" in text
