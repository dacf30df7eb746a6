"""Count the kernels of an optimized XLA HLO by the model source lines that produced them.

The real-size decode step launches thousands of kernels (~3400 at B=1 in stop 9) and the gaps between them cost
about as much as the bigger kernels; this tells which model code makes them. Input: the gzipped HLO text that
`bench/decode_step.py` writes to $OUT (`decode_step_b<B>.hlo.txt.gz`, from `compile().as_text()`). Every
fusion / custom call / copy of the entry computation is attributed through its stack_frame_id to the two
innermost frames outside the benchmark script.

    python3 tools/hlo_kernels.py decode_step_b1.hlo.txt.gz [TOP]
"""

from __future__ import annotations

import collections
import gzip
import re
import sys

KERNEL_OPS = ("fusion", "custom-call", "copy", "fusion-start", "all-reduce")


def _table(hlo: str, name: str, pattern: str) -> dict[int, tuple[str, ...]]:
    """One of the HLO text's stack-frame tables (FileNames, FunctionNames, FileLocations, StackFrames)."""
    start = hlo.find("\n" + name + "\n")
    end = hlo.find("\n\n", start + 1)
    rows = {}
    for line in hlo[start:end].splitlines()[1:]:
        m = re.match(pattern, line.strip())
        if m:
            rows[int(m.group(1))] = m.groups()[1:]
    return rows


def kernels_by_source(hlo: str, skip_file: str = "decode_step.py") -> tuple[int, collections.Counter]:
    files = {k: v[0] for k, v in _table(hlo, "FileNames", r'(\d+) "([^"]+)"').items()}
    funcs = {k: v[0] for k, v in _table(hlo, "FunctionNames", r'(\d+) "([^"]+)"').items()}
    locs = _table(hlo, "FileLocations", r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
    frames = _table(hlo, "StackFrames", r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)")

    def chain(frame: int) -> list[str]:
        out = []
        while frame in frames and len(out) < 30:
            loc, parent = frames[frame]
            f, fn, line = locs[int(loc)]
            out.append(f"{files[int(f)].split('/')[-1]}:{funcs[int(fn)]}:{line}")
            if int(parent) == frame:
                break
            frame = int(parent)
        return out

    entry = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", hlo, re.S).group(1)
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in entry.splitlines():
        if not re.match(r"\s*(ROOT )?%[\w.\-]+ = .*? (" + "|".join(KERNEL_OPS) + r")\(", line):
            continue
        total += 1
        sf = re.search(r"stack_frame_id=(\d+)", line)
        where = [x for x in (chain(int(sf.group(1))) if sf else ["?"]) if not x.startswith(skip_file)]
        counts[" < ".join(where[:2])] += 1
    return total, counts


if __name__ == "__main__":
    with gzip.open(sys.argv[1], "rt") as fh:
        total, counts = kernels_by_source(fh.read())
    print("kernels", total)
    for where, n in counts.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 45):
        print(f"{n:5d}  {where}")
