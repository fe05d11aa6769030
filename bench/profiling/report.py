"""Summarize folded stacks (``frame;frame;...;frame count`` lines) per process: py-spy's raw output (its
``process N:"cmd"`` frames name the process) or the files bench/profiling/sitecustomize.py writes (one file per
process, its header line naming it).

    python bench/profiling/report.py serve-profile.txt [--top 30]      # also .txt.gz
    python bench/profiling/report.py prof/*.txt

For each process, by sample count: the functions on the stack (each counted once per sample, so a share is the
share of samples in which the function was running or below a running frame) and the innermost frames.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def fold(paths: list[Path]) -> dict[str, collections.Counter[tuple[str, ...]]]:
    """Stacks (outermost first, line numbers dropped) with their counts, by process name."""
    stacks: dict[str, collections.Counter[tuple[str, ...]]] = collections.defaultdict(collections.Counter)
    for path in paths:
        name = path.name
        text = gzip.decompress(path.read_bytes()).decode(errors="replace") if path.suffix == ".gz" \
            else path.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("#"):
                name = f"{path.name}: {line[1:].strip()[:120]}"
                continue
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            process = name
            marks = [i for i, f in enumerate(frames) if f.startswith("process ")]
            if marks:  # py-spy: the innermost process frame names the process; its frames follow
                process, frames = frames[marks[-1]].split(":")[0], frames[marks[-1] + 1:]
            stacks[process][tuple(_LINE.sub(")", f) for f in frames)] += int(count)
    return stacks


def report(stacks: dict[str, collections.Counter[tuple[str, ...]]], top: int) -> str:
    out = []
    for process, counts in sorted(stacks.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        inclusive: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        for frames, n in counts.items():
            for f in set(frames):
                inclusive[f] += n
            if frames:
                leaves[frames[-1]] += n
        out.append(f"== {process}: {total} samples")
        out += [f"  {n:7d} {100 * n / total:5.1f} %  {f[:140]}" for f, n in inclusive.most_common(top)]
        out.append("  -- innermost frames")
        out += [f"  {n:7d} {100 * n / total:5.1f} %  {f[:140]}" for f, n in leaves.most_common(top // 2)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    print(report(fold(args.files), args.top))


if __name__ == "__main__":
    main()
