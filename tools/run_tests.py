"""Runs the test suite with one pytest process per test file, two files at a time: the README's test command and
.ci/run.

Why one process per file: with jaxlib 0.11.2 on CPU, one process running the whole suite segfaulted inside XLA
after ~85% of it (stop 11: twice at the same test, with and without the persistent compilation cache; a native
backtrace of the same crash on a branch: libgcc's unwinder reading freed memory while a C++ exception unwound,
docs/lessons-learned.md). State that builds up in one long-lived process; every file passes in its own.

Why two at a time: most of the suite's time is XLA compiling, which runs on one core, and CI's machine has two.
The files share the persistent compilation cache (tests/conftest.py); a cache size limit is set so that jax takes
its file lock around every read and write, and two processes never see a half-written entry. The longest files
start first (tests/durations.json, seconds of a quiet run) so the two workers end together.

    python tools/run_tests.py                # the default suite
    python tools/run_tests.py -j 1           # one file at a time
    python tools/run_tests.py -m slow        # other arguments go to every file's pytest run
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
# With a size limit jax's cache locks every access (jax/_src/lru_cache.py); 64 GiB never evicts in practice.
CACHE_ENV = {"JAX_COMPILATION_CACHE_MAX_SIZE": str(64 << 30)}


def run_file(path: Path, pytest_args: list[str]) -> tuple[str, int, float]:
    """One file's pytest run: (its output, exit code, seconds)."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *pytest_args],
                         cwd=ROOT, capture_output=True, text=True, env=os.environ | CACHE_ENV)
    return run.stdout + run.stderr, run.returncode, time.perf_counter() - t0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="files run at once")
    args, pytest_args = parser.parse_known_args(argv)
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    files = sorted((ROOT / "tests").glob("test_*.py"), key=lambda p: (-known.get(p.name, 60), p.name))

    totals: collections.Counter = collections.Counter()
    failed, seconds = [], {}
    print_lock = threading.Lock()
    t_start = time.perf_counter()

    def report(path: Path, output: str, code: int, took: float) -> None:
        lines = [ln for ln in output.splitlines() if COUNTS.search(ln) and " in " in ln]
        summary = lines[-1].strip("= ") if lines else f"no summary (exit code {code})"
        with print_lock:
            for n, what in COUNTS.findall(summary):
                totals["errors" if what == "error" else what] += int(n)
            seconds[path.name] = round(took)
            print(f"{path.name:<40} {summary}  [{took:.0f} s]", flush=True)
            if code not in (0, 5):  # 5: every test of the file deselected (e.g. by -m slow)
                failed.append(path.name)
                print(output[-6000:], flush=True)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(run_file, path, pytest_args): path for path in files}
        for future in concurrent.futures.as_completed(futures):
            report(futures[future], *future.result())

    (ROOT / ".test_durations_last.json").write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
    n_failed = totals["failed"] + totals["errors"]
    others = ", ".join(f"{n} {what}" for what, n in sorted(totals.items()) if what not in ("passed", "failed", "errors"))
    print(f"\n{len(files)} files in {time.perf_counter() - t_start:.0f} s with {args.jobs} at a time"
          + (f"; {others}" if others else "") + (f"; FAILED files: {', '.join(failed)}" if failed else ""))
    print(f"tests: {totals['passed']} passed, {n_failed} failed, {totals['skipped']} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
