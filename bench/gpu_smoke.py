"""GPU smoke check of the model path: the demo model and a quantized fixture on the accelerator, with the Pallas
kernels (FLASHNEXT_KERNELS=pallas) and with the pure-JAX references, against the committed fp32 references.

Correctness only (tiny models): it shows the kernel switch works inside the model on a real GPU. Prints a table
last and writes JSON to $OUT (or ./gpu_smoke.json).
"""

import datetime
import json
import os
import sys
import time

import jax
import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashnext_jax  # noqa: E402

# The switch is read when a step is traced, so each implementation runs in its own process: `impl` from argv.
IMPL = sys.argv[1] if len(sys.argv) > 1 else "auto"
rows = []
ref_tiny = np.load("tests/fixtures/reference_tiny.npz")
ref_q = load_file("tests/fixtures/quant/reference_logits.safetensors")
for impl in (IMPL,):
    os.environ["FLASHNEXT_KERNELS"] = impl
    for name, path, dtype, ids, ref in [
        ("demo fp32", None, "float32", ref_tiny["long/ids"], ref_tiny["long/logits"]),
        ("demo bf16", None, "bfloat16", ref_tiny["long/ids"], ref_tiny["long/logits"]),
        ("ct int4/6/8 fp32", "tests/fixtures/quant/ct", "float32", ref_q["input_ids"][0], ref_q["ct"][0]),
        ("ct int4/6/8 bf16", "tests/fixtures/quant/ct", "bfloat16", ref_q["input_ids"][0], ref_q["ct"][0]),
        ("gptq fp32", "tests/fixtures/quant/gptq", "float32", ref_q["input_ids"][0], ref_q["gptq"][0]),
    ]:
        model = flashnext_jax.load(path, dtype=dtype)
        t0 = time.perf_counter()
        got = model.logits(ids)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.logits(ids)
        again = time.perf_counter() - t0
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
        gen = model.generate(ids[:16], max_new_tokens=8) if "demo" in name else None
        rows.append(dict(impl=impl, case=name, rel_max_diff=rel, argmax_agree=agree, first_call_s=first,
                         second_call_s=again, generated=gen))

out = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax_version=jax.__version__,
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(), rows=rows)
path = os.path.join(os.environ.get("OUT", "."), f"gpu_smoke_{IMPL}.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print(f"{'impl':10} {'case':18} {'rel diff':>10} {'argmax':>7} {'1st s':>7} {'2nd s':>7}")
for r in rows:
    print(f"{r['impl']:10} {r['case']:18} {r['rel_max_diff']:10.2e} {r['argmax_agree']:7.3f} "
          f"{r['first_call_s']:7.2f} {r['second_call_s']:7.3f}")
