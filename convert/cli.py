"""flashnext-convert SRC DST [--pp-partition 16,17,15] [--force] [--verify]

Errors print one line `flashnext-convert: error: ...` on stderr and exit with status 2 (bad input) or 1
(unexpected failure); DST is never left behind (output goes to a temporary sibling, renamed when complete).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _partition(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {s!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flashnext-convert",
                                 description="Convert a Qwen3.8-Flash-Next HF checkpoint (compressed-tensors, "
                                             "AutoRound, GPTQ/AWQ, bf16, block-FP8) into flashnext-jax's format.")
    ap.add_argument("src", help="HF checkpoint directory")
    ap.add_argument("dst", help="output directory (must not exist unless --force)")
    ap.add_argument("--pp-partition", type=_partition, default=None, metavar="N0,N1,...",
                    help="layers per pipeline stage, e.g. 16,17,15: one directory per stage")
    ap.add_argument("--force", action="store_true", help="replace an existing DST (only once the new one is complete)")
    ap.add_argument("--verify", action="store_true", help="re-read and check every tensor before publishing DST")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--ngram-part-gib", type=float, default=4.0, help="max size of one n-gram table part file")
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the converter never needs an accelerator
    from convert.errors import ConvertError
    from convert.writer import convert

    t0 = time.time()
    try:
        m = convert(args.src, args.dst, pp_partition=args.pp_partition, force=args.force, verify=args.verify,
                    progress=not args.no_progress, ngram_part_bytes=int(args.ngram_part_gib * (1 << 30)))
    except ConvertError as e:
        print(f"flashnext-convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flashnext-convert: error: interrupted (no output written)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, whatever happened
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"flashnext-convert: error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    dt = time.time() - t0
    gb = m["source"]["bytes"] / 1e9
    print(f"flashnext-convert: wrote {args.dst}: {len(m['tensors'])} tensors, {len(m['stages'])} stage(s), "
          f"{gb:.3f} GB in {dt:.1f} s ({gb / max(dt, 1e-9):.2f} GB/s){' (verified)' if args.verify else ''}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
