"""GPU smoke of the engine on the kernel path: the demo model and the int4/6/8 compressed-tensors fixture in bf16,
served by `LLM` (MTP off and on, chunked prefill, the GDN state updated in place in the store by the Pallas
kernels, GEMV decode matmuls) against `Model.generate` run solo on the same path. Correctness only (tiny models).

  FLASHNEXT_KERNELS=pallas PYTHONPATH=. python3 bench/engine_gpu_smoke.py     # JSON to $OUT (or .)
"""

import datetime
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashnext_jax as fj  # noqa: E402
from flashnext_jax import gdn  # noqa: E402
from flashnext_jax.runner import RealRunner  # noqa: E402

PROMPTS = [[5, 77, 301, 12, 9, 140, 33], [400, 2, 2, 81], [17] * 11]


def main():
    rows = []
    calls = []
    real = gdn.delta_rule_in_store
    gdn.delta_rule_in_store = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    for name, path in [("demo", None), ("ct int4/6/8", "tests/fixtures/quant/ct")]:
        model = fj.load(path, dtype="bfloat16")
        vocab_hi = model.cfg.vocab_size - 1
        prompts = [[min(t, vocab_hi) for t in p] for p in PROMPTS]
        for k in (0, 1):
            if k and not model.has_mtp:
                continue
            calls.clear()
            spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
            lm = fj.LLM(RealRunner(model, k), speculative_config=spec, max_model_len=64, page_size=8, max_num_seqs=2,
                        max_num_batched_tokens=5)
            t0 = time.perf_counter()
            outs = lm.generate(prompts, fj.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            dt = time.perf_counter() - t0
            solo = [model.generate(p, 8) for p in prompts]
            same = [o.token_ids == s for o, s in zip(outs, solo)]
            agree = sum(a == b for o, s in zip(outs, solo) for a, b in zip(o.token_ids, s)) / sum(map(len, solo))
            rows.append(dict(model=name, mtp_k=k, requests_equal_solo=same, token_agreement=agree,
                             in_place_gdn_calls=len(calls), engine_s=dt, steps=lm.engine.counters["steps"]))
            print(rows[-1], flush=True)

    out = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax_version=jax.__version__,
               kernels=os.environ.get("FLASHNEXT_KERNELS", "auto"),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "engine_gpu_smoke.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'model':12} {'k':>2} {'equal solo':>12} {'agree':>6} {'in-place calls':>14} {'steps':>6}")
    for r in rows:
        print(f"{r['model']:12} {r['mtp_k']:2d} {str(r['requests_equal_solo']):>12} {r['token_agreement']:6.3f} "
              f"{r['in_place_gdn_calls']:14d} {r['steps']:6d}")


if __name__ == "__main__":
    main()
