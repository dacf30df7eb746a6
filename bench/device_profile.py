"""Where a program's GPU time goes: kernel durations from the profiler's device trace, grouped by the model's
named scopes (`model.decoder_layer`: ple, hyper, gdn, qsa (select, attend), moe).

A kernel event names its HLO instruction (the `hlo_op` stat, else the kernel name for XLA's own fusions); the
instruction's `op_name` metadata, read from the optimized HLO that XLA dumps (`XLA_FLAGS=--xla_dump_to=DIR`), holds
the scope path, e.g. `jit(run)/while/body/moe/dot_general`. Without a dump every kernel lands in "unmapped" and
only the per-kernel table is informative.

  with device_profile.capture() as trace: fn()        # then device_profile.summarize(trace.xspace, dump_dir)
"""

from __future__ import annotations

import contextlib
import glob
import os
import re

SCOPES = ("ple", "hyper", "gdn", "qsa", "select", "attend", "moe")
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]*)"')


class _Trace:
    xspace: bytes = b""


@contextlib.contextmanager
def capture():
    """Profiles everything run inside the block; the serialized XSpace is in `.xspace` afterwards."""
    from jax._src.lib import _profiler

    trace = _Trace()
    session = _profiler.ProfilerSession()
    try:
        yield trace
    finally:
        trace.xspace = session.stop()


def op_names(dump_dir: str | None) -> dict[str, str]:
    """HLO instruction name -> op_name metadata, from every `*after_optimizations.txt` in an XLA dump directory.
    Names are also entered with '.' and '-' as '_' (how XLA's GPU backend names the kernels of its fusions)."""
    names: dict[str, str] = {}
    for path in glob.glob(os.path.join(dump_dir or "", "*after_optimizations.txt")) if dump_dir else []:
        with open(path) as f:
            for line in f:
                m = _INSTRUCTION.match(line)
                if m:
                    names.setdefault(m.group(1), m.group(2))
                    names.setdefault(re.sub(r"[.\-]", "_", m.group(1)), m.group(2))
    return names


def scope_of(op_name: str | None) -> str:
    """'jit(run)/while/body/qsa/select/top_k' -> 'qsa/select'; a path with none of SCOPES -> 'other'."""
    if op_name is None:
        return "unmapped"
    parts = [p for p in op_name.split("/") if p in SCOPES]
    return "/".join(dict.fromkeys(parts)) or "other"


def summarize(xspace: bytes, dump_dir: str | None = None, top: int = 25) -> dict:
    """{total_ms, kernels, by_scope: {scope: ms}, top_kernels: [{kernel, scope, ms, calls}], stat_keys} of the
    GPU kernels in a trace (every stream line of every GPU plane)."""
    from jax.profiler import ProfileData

    names = op_names(dump_dir)
    by_scope: dict[str, float] = {}
    by_kernel: dict[tuple[str, str], list] = {}
    stat_keys: set[str] = set()
    total, count = 0.0, 0
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                stat_keys.update(stats)
                op = str(stats.get("hlo_op", ev.name))
                scope = scope_of(names.get(op) or names.get(ev.name))
                ms = ev.duration_ns * 1e-6
                total, count = total + ms, count + 1
                by_scope[scope] = by_scope.get(scope, 0.0) + ms
                entry = by_kernel.setdefault((ev.name[:80], scope), [0.0, 0])
                entry[0] += ms
                entry[1] += 1
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(total_ms=total, kernels=count, hlo_ops_mapped=len(names) > 0,
                by_scope=dict(sorted(by_scope.items(), key=lambda kv: -kv[1])),
                top_kernels=[dict(kernel=k, scope=s, ms=v[0], calls=v[1]) for (k, s), v in ranked],
                stat_keys=sorted(stat_keys))


def print_summary(profile: dict, label: str = "") -> None:
    print(f"device profile {label}: {profile['total_ms']:.1f} ms in {profile['kernels']} kernels "
          f"(scopes mapped: {profile['hlo_ops_mapped']}; event stats: {', '.join(profile['stat_keys'][:12])})")
    for scope, ms in profile["by_scope"].items():
        print(f"  {scope:<14} {ms:10.1f} ms  {100 * ms / max(profile['total_ms'], 1e-9):5.1f}%")
    for k in profile["top_kernels"]:
        print(f"  {k['ms']:10.1f} ms {k['calls']:6d}x  {k['scope']:<12} {k['kernel']}")
