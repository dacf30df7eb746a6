"""Runs the test suite with one pytest process per test file: the README's test command and .ci/run.

Why not one process: with jaxlib 0.11.2 on CPU, one process running the whole suite segfaulted inside XLA after
~85% of it (stop 11: twice at the same test, with and without the persistent compilation cache; a native
backtrace of the same crash on a branch: libgcc's unwinder reading freed memory while a C++ exception unwound,
docs/lessons-learned.md). State that builds up in one long-lived process; every file passes
in its own. The files run one after another, so the compilation cache (tests/conftest.py) is shared but never
written by two processes at once.

    python tools/run_tests.py                # the default suite
    python tools/run_tests.py -m slow        # extra pytest arguments go to every file's run
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def main(argv: list[str]) -> int:
    totals: collections.Counter = collections.Counter()
    failed = []
    t_start = time.perf_counter()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *argv],
                             cwd=ROOT, capture_output=True, text=True)
        output = run.stdout + run.stderr
        lines = [ln for ln in output.splitlines() if COUNTS.search(ln) and " in " in ln]
        summary = lines[-1].strip("= ") if lines else f"no summary (exit code {run.returncode})"
        for n, what in COUNTS.findall(summary):
            totals["errors" if what == "error" else what] += int(n)
        print(f"{path.name:<40} {summary}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        if run.returncode not in (0, 5):  # 5: every test of the file deselected (e.g. by -m slow)
            failed.append(path.name)
            print(output[-6000:], flush=True)
    print(f"\n{', '.join(f'{n} {what}' for what, n in sorted(totals.items()))} in "
          f"{time.perf_counter() - t_start:.0f} s" + (f"; FAILED files: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
