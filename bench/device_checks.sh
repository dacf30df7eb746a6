#!/usr/bin/env bash
# The GPU checks docs/STATUS.md "Suggested order next" lists, grouped into device calls of <= 10 minutes (a fresh
# machine costs ~90 s of device time; each call should hold as many checks as fit). Results land in $OUT.
#   bash bench/device_checks.sh invariance   # issue 19: both modes at 4 layers with a decode profile; QSA splits
#   bash bench/device_checks.sh offload      # issue 14 item 6: host-memory patterns, then the decode cost at 128K
#   bash bench/device_checks.sh invariance12 # issue 19 at 12 layers, invariant mode only
#   bash bench/device_checks.sh async        # issue 16: async scheduling beside the plain engine (~4 min)
#   bash bench/device_checks.sh kinds        # issue 19 with token kinds (both modes, 4 layers), then the async probe
#   bash bench/device_checks.sh invariance48 invariant|fast|both
#                                            # issue 19 at the real size (48 layers, 512 experts; needs_h200), one
#                                            # mode per call (each compiles ~4-6 min; both: the fast mode timing
#                                            # only, in one call), else bench/batch_invariance.py --merge the JSONs
#   bash bench/device_checks.sh prefill      # issue 19: TTFT of 8K/16K prompts, invariant vs fast (4 layers)
#   bash bench/device_checks.sh longctx      # issue 14's report on the H200 (512 experts; needs_h200): TTFT/decode at
#                                            # 4K-262K in the default (batch-invariant) mode, first vs second 32K
#   bash bench/device_checks.sh order        # issue 16: the async engine alone, then after the plain one (48 layers,
#                                            # B = 1), with XLA's command-buffer update log (allocations moved per launch)
#   bash bench/device_checks.sh cmdbuf       # tools/cmdbuf_probe.py (what a moved input costs a CUDA-graph launch)
#   bash bench/device_checks.sh probe48      # issue 16: the async probe at 48 layers (device-bound, as the real size),
#                                            # then again with XLA's command buffers off (does a graph update block?)
# The device machine lacks llguidance and tqdm: carry .whl/ (their py3.12 wheels, git-ignored) and first run
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-}" in
  invariance)
    timeout 330 python3 bench/batch_invariance.py --layers 4 --rounds 1 --steps 8 --profile-steps 4 \
        --deadline-s 300 --out "$OUT/batch_invariance_4layers.json" > "$OUT/bi4.log" 2>&1
    echo "batch_invariance rc=$?"; tail -n 25 "$OUT/bi4.log"
    timeout 200 python3 bench/qsa_kernels.py --reps 5 --splits 4,8,16 --out "$OUT/qsa_kernels.json" \
        > "$OUT/qsa_kernels.log" 2>&1
    echo "qsa_kernels rc=$?"; tail -n 30 "$OUT/qsa_kernels.log" ;;
  offload)
    timeout 150 python3 tools/host_offload_probe.py --out "$OUT/host_offload_probe.json" > "$OUT/probe.log" 2>&1
    echo "probe rc=$?"; tail -n 20 "$OUT/probe.log"
    EXPERTS=256; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && EXPERTS=512
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 400 python3 bench/qsa_offload.py --experts $EXPERTS \
        --out "$OUT/qsa_offload.json" > "$OUT/qsa_offload.log" 2>&1
    echo "qsa_offload rc=$?"; tail -n 20 "$OUT/qsa_offload.log" ;;
  invariance12)
    timeout 560 python3 bench/batch_invariance.py --layers 12 --rounds 1 --steps 8 --modes invariant \
        --deadline-s 520 --out "$OUT/batch_invariance_12layers.json" > "$OUT/bi12.log" 2>&1
    echo "batch_invariance rc=$?"; tail -n 25 "$OUT/bi12.log" ;;
  async)
    # --experts 32: the same bytes per decode step as 512 (each token reads its top-10), a minute less to build
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 560 python3 bench/real_size.py --experts 32 --no-mtp \
        --async-scheduling --deadline-s 480 --out "$OUT/real_size_async.json" > "$OUT/real_size_async.log" 2>&1
    echo "real_size rc=$?"; grep -v "compiling engine steps" "$OUT/real_size_async.log" | tail -n 25 ;;
  kinds)
    # token kinds (flashnext_jax/token_kinds.py): bitwise solo == B=2/8/mixed and the invariant decode cost, then
    # where the async engine's launch time goes (bench/async_probe.py, nothing blocking)
    timeout 330 python3 bench/batch_invariance.py --layers 4 --rounds 1 --steps 8 --profile-steps 4 \
        --deadline-s 300 --compile-threads 6 --out "$OUT/batch_invariance_4layers.json" > "$OUT/bi4.log" 2>&1
    echo "batch_invariance rc=$?"; grep -v "compiling\|compiled run" "$OUT/bi4.log" | tail -n 25
    timeout 200 python3 bench/async_probe.py --layers 4 --steps 30 --out "$OUT/async_probe.json" \
        > "$OUT/async_probe.log" 2>&1
    echo "async_probe rc=$?"; tail -n 6 "$OUT/async_probe.log" ;;
  probe48)
    timeout 330 python3 bench/async_probe.py --layers 48 --steps 30 --out "$OUT/async_probe_48.json" \
        > "$OUT/async_probe_48.log" 2>&1
    echo "async_probe 48 rc=$?"; grep -v "^    " "$OUT/async_probe_48.log" | tail -n 6; grep "^    " "$OUT/async_probe_48.log" | head -24
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 220 python3 bench/async_probe.py --layers 48 --steps 30 \
        --out "$OUT/async_probe_48_no_cmdbuf.json" > "$OUT/async_probe_48_no_cmdbuf.log" 2>&1
    echo "async_probe 48 no command buffers rc=$?"; tail -n 6 "$OUT/async_probe_48_no_cmdbuf.log" ;;
  probe48async)
    # the async engine alone at B = 1 (probe48 ran out of time compiling both engines; its plain row is committed:
    # 8.61 ms a step, launch 1.30 ms), then with XLA's exclusive GPU lock (cheaper command-buffer updates: does a
    # re-record of the step's ~2,250-node command buffer, for buffers at new addresses, hold the launch?)
    timeout 280 python3 bench/async_probe.py --layers 48 --steps 30 --engines async --batches 1 \
        --out "$OUT/async_probe_48_async.json" > "$OUT/async_probe_48_async.log" 2>&1
    echo "async_probe 48 async rc=$?"; grep -v "compiling" "$OUT/async_probe_48_async.log" | tail -n 12
    XLA_FLAGS=--xla_gpu_require_exclusive_lock=true timeout 280 python3 bench/async_probe.py --layers 48 --steps 30 \
        --engines async --batches 1 --out "$OUT/async_probe_48_async_lock.json" > "$OUT/async_probe_48_async_lock.log" 2>&1
    echo "async_probe 48 async, exclusive lock rc=$?"; grep -v "compiling" "$OUT/async_probe_48_async_lock.log" | tail -n 12 ;;
  longctx)
    # as bench/h200_long_context_checks.sh report (0.7: room for the run-time copy of a pool leaf, stop 26)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 575 python3 bench/long_context.py --experts 512 --decode-steps 16 \
        --gpu-memory-utilization 0.7 ${LONGCTX_ARGS:-} --out "$OUT/long_context.json" > "$OUT/long_context.log" 2>&1
    echo "long_context rc=$?"; grep -v "compiling engine steps:" "$OUT/long_context.log" |
        grep -i "pool\|compiled an\|prompt_tokens\|error\|invariant" | cut -c1-300; tail -n 8 "$OUT/long_context.log" ;;
  cmdbuf)
    timeout 150 python3 tools/cmdbuf_probe.py --ops 1000 --out "$OUT/cmdbuf_probe.json" > "$OUT/cmdbuf_probe.log" 2>&1
    echo "cmdbuf_probe rc=$?"; tail -n 7 "$OUT/cmdbuf_probe.log" ;;
  order)
    # stop 47: the async engine alone took 11.86 ms a step, after the plain engine in one process 5.84-5.90 ms
    # (bench/results/async_probe_48layers_*_h100.*); XLA logs every command-buffer update with the number of
    # allocations that moved (command_buffer_thunk.cc, VLOG 3): is the async launch re-recording, and for which?
    for engines in async plain,async; do
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 270 python3 bench/async_probe.py \
          --layers 48 --steps 30 --engines $engines --batches 1 --out "$OUT/async_probe_48_order_${engines/,/_}.json" \
          > "$OUT/order_${engines/,/_}.log" 2>&1
      echo "engines $engines rc=$?"; grep -c "Update command buffer" "$OUT/order_${engines/,/_}.log"
      grep -o "updated_allocs=[0-9]*" "$OUT/order_${engines/,/_}.log" | sort | uniq -c | sort -rn | head -5
      grep "^plain \|^async " "$OUT/order_${engines/,/_}.log"
    done ;;
  invariance48)
    case "${2:-}" in
      invariant) MODE_ARGS="--modes invariant" ;;
      fast) MODE_ARGS="--modes non_invariant --timing-only non_invariant" ;;
      both) MODE_ARGS="--modes invariant,non_invariant --timing-only non_invariant" ;;  # one build, 12 compiles
      *) echo "usage: $0 invariance48 invariant|fast|both" >&2; exit 2 ;;
    esac
    # EXPERTS=32 on an H100 (the 512-expert weights, ~68 GB, leave no room there): a decode step reads the same
    # bytes (each token its top-10 experts), so the cost at depth is the real one; the routing is not
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(( ${DEADLINE:-520} + 60 )) python3 bench/batch_invariance.py \
        --layers 48 --experts ${EXPERTS:-512} --compile-threads 8 --deadline-s ${DEADLINE:-520} $MODE_ARGS \
        --out "$OUT/batch_invariance_48layers_${EXPERTS:-512}experts_$2.json" > "$OUT/bi48_$2.log" 2>&1
    echo "batch_invariance 48 layers $2 rc=$?"; grep -v "compiling\|compiled run" "$OUT/bi48_$2.log" | tail -n 25 ;;
  prefill)
    timeout 400 python3 bench/invariant_prefill.py --layers 4 --reps 3 --out "$OUT/invariant_prefill.json" \
        > "$OUT/invariant_prefill.log" 2>&1
    echo "invariant_prefill rc=$?"; grep -v "compiling engine\|INFO" "$OUT/invariant_prefill.log" | tail -n 8 ;;
  *) echo "usage: $0 invariance|offload|invariance12|async|kinds|probe48|probe48async|invariance48|prefill|longctx|cmdbuf|order" >&2; exit 2 ;;
esac
