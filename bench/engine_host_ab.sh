#!/usr/bin/env bash
# One device call: the engine step at the real size under three XLA command-buffer settings (bench/engine_step.py).
#   default       XLA's command buffers (CUDA graphs) updated node by node whenever a buffer address changes
#   skip_temp     --xla_gpu_command_buffer_update_mode=SKIP_TEMP with the VMM allocator: the temp buffers keep
#                 fixed virtual addresses, so only commands reading changed parameters are updated
#   no_cmdbuf     no command buffers: every kernel launched from the host
# Each writes $OUT/engine_host_<name>.json with the host phases per step (build_batch, dispatch, device_wait,
# commit). Stop 10 measured default and no_cmdbuf (bench/results/engine_host_profile.json): dispatch 3.5 vs 16.8 ms.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
ARGS="--batch 1 --prompt 1 --tokens 30 --page-size 64 ${ENGINE_AB_ARGS:-}"
OUT=${OUT:-.}
timeout 150 python bench/engine_step.py $ARGS --out "$OUT/engine_host_default.json" 2>&1 | grep "^{'batch'" | cut -c1-600
XLA_PYTHON_CLIENT_ALLOCATOR=vmm XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" \
  timeout 150 python bench/engine_step.py $ARGS --out "$OUT/engine_host_skip_temp.json" 2>&1 | grep "^{'batch'\|Error\|error" | cut -c1-600
XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
  timeout 150 python bench/engine_step.py $ARGS --out "$OUT/engine_host_no_cmdbuf.json" 2>&1 | grep "^{'batch'" | cut -c1-600
