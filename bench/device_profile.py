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


def device_events(xspace: bytes):
    """(name, start_ns, duration_ns, stats) of every device activity in a trace: the events of every stream line
    of every GPU plane (kernels and copies). A trace without a GPU (a CPU run) gives XLA's CPU thunks instead, the
    host events that name their HLO instruction, so the same parsing runs in the CPU tests."""
    from jax.profiler import ProfileData

    planes = list(ProfileData.from_serialized_xspace(xspace).planes)
    gpus = [p for p in planes if p.name.startswith("/device:GPU")]
    for plane in gpus or [p for p in planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            if gpus and not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                if gpus or "hlo_op" in stats:
                    yield ev.name, ev.start_ns, ev.duration_ns, stats


def is_copy(name: str) -> bool:
    """A memory copy or set on a stream (host<->device transfers), not a kernel."""
    return name.lower().startswith(("memcpy", "memset"))


def timeline(xspace: bytes) -> dict:
    """Counts and times of the device activity in a trace (one device): kernels (copies apart) and their summed
    duration, copies, `busy_ms` (the union of every activity's interval: the time the device was doing something,
    overlapping streams counted once), `span_ms` (first start to last end) and the kernels per XLA module
    (`hlo_module` stat: the model step, the sampler, the store's small programs)."""
    spans, kernels, kernel_ms, copies, copy_ms, by_module = [], 0, 0.0, 0, 0.0, {}
    for name, start, dur, stats in device_events(xspace):
        spans.append((start, start + dur))
        if is_copy(name):
            copies, copy_ms = copies + 1, copy_ms + dur * 1e-6
            continue
        kernels, kernel_ms = kernels + 1, kernel_ms + dur * 1e-6
        module = str(stats.get("hlo_module", "?"))
        by_module[module] = by_module.get(module, 0) + 1
    busy, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return dict(kernels=kernels, kernel_ms=kernel_ms, copies=copies, copy_ms=copy_ms, busy_ms=busy * 1e-6,
                span_ms=(max(b for _, b in spans) - min(a for a, _ in spans)) * 1e-6 if spans else 0.0,
                kernels_by_module=dict(sorted(by_module.items(), key=lambda kv: -kv[1])))


def summarize(xspace: bytes, dump_dir: str | None = None, top: int = 25) -> dict:
    """{total_ms, kernels, by_scope: {scope: ms}, top_kernels: [{kernel, scope, ms, calls}], stat_keys} of the
    device activity in a trace (`device_events`)."""
    names = op_names(dump_dir)
    by_scope: dict[str, float] = {}
    by_kernel: dict[tuple[str, str], list] = {}
    stat_keys: set[str] = set()
    total, count = 0.0, 0
    for name, _, duration_ns, stats in device_events(xspace):
        stat_keys.update(stats)
        op = str(stats.get("hlo_op", name))
        scope = scope_of(names.get(op) or names.get(name))
        ms = duration_ns * 1e-6
        total, count = total + ms, count + 1
        by_scope[scope] = by_scope.get(scope, 0.0) + ms
        entry = by_kernel.setdefault((name[:80], scope), [0.0, 0])
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
