"""y = x @ W^T for plain (unquantized) bf16 / fp16 weights stored [N, K], batch-invariant: Pallas kernel + reference.

Why: on the GPU XLA's dot (cuBLAS) picks its algorithm, tiling and split-K by the row count M, so a token's output
row rounds differently depending on how many other tokens share its step (pallas_kernels/fixed_order.py,
docs/batch-invariance.md). This kernel computes row i of the result with the same sequence of fp32 additions for
every M, so the row is bitwise the same whether it runs alone or among 8191 others.

What is fixed (depends on K and N only): the K loop runs in blocks of BK = the largest power of two <= 64 dividing
K (64 for every real model width), one fp32 accumulator per output element, the blocks added in index order; the
K blocks are cut into S contiguous splits (`k_splits`: more splits for fewer column tiles, so a small N such as
in_proj_a's 48 columns runs 24 programs instead of 3, each looping 5 blocks instead of 40), and the S fp32
partials are added in a fixed pairwise tree of elementwise adds (fixed_order.pairwise_sum) after the kernel. The
weights are the tensor-core dot's LEFT operand (acc[BN, BM] += w_tile[BN, BK] @ x_tile^T[BK, BM],
transposed once at the end), as quant_matmul's DenseConfig.weights_left: tokens are the wgmma N dimension, and the
quantized kernel in that form measured the same bits at every M from 1 to 8192 (bench/results/quant_invariance_*.json).
BN (64 where the padded N allows, else 32 or 16) follows N.

What may vary with M: BM (16 for M <= 16, else 64) and the number of row tiles (never S: a split that followed
the row tiles would change a row's sum). Neither changes a row's arithmetic:
the rows of x are independent columns of the dot, and x is zero-padded to a multiple of BM by the wrapper (pad
rows only produce rows that are sliced off). N is zero-padded to a multiple of 16 (N = 1 for a gate, N = 48, ...)
and sliced the same way.

Backend: `pl.pallas_call` through the Triton backend, like quant_matmul.py: the BlockSpecs hand each program a
[BM, K] row block of x and a [BN, K] row block of W by reference, and the kernel loads [*, BK] slices in its loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order
from pallas_kernels.quant_layout import pow2_divisor

try:  # the Triton compiler params; absent or unused in interpret mode
    from jax.experimental.pallas import triton as pl_triton
except Exception:  # pragma: no cover
    pl_triton = None

DTYPES = (jnp.bfloat16, jnp.float16)
N_ALIGN = 16  # N is padded to a multiple of this (tensor-core tile rows)
NUM_WARPS = 4
NUM_STAGES = 3


def dense_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w[N, K]^T accumulated in float32, result in x.dtype (XLA's dot: not batch-invariant on the GPU)."""
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def block_k(k: int) -> int:
    """The K block of every call with this K (raises ValueError when K is not a multiple of 16)."""
    if k <= 0 or k % 16:
        raise ValueError(f"dense_matmul needs K to be a positive multiple of 16, got K={k}")
    return pow2_divisor(k, 64)


def block_m(m: int) -> int:
    return 16 if m <= 16 else 64


def block_n(n_padded: int) -> int:
    return pow2_divisor(n_padded, 64)


TARGET_PROGRAMS = 128  # split K until the column tiles x splits reach this (about the SMs of an H100 / H200)
MIN_BLOCKS_PER_SPLIT = 4


def k_splits(k: int, n_padded: int) -> int:
    """S, the number of contiguous K splits (a function of K and N only): doubled while the column tiles x S stay
    within TARGET_PROGRAMS and every split keeps at least MIN_BLOCKS_PER_SPLIT blocks of the K loop."""
    tiles, n_k = n_padded // block_n(n_padded), k // block_k(k)
    s = 1
    while tiles * s * 2 <= TARGET_PROGRAMS and n_k % (s * 2) == 0 and n_k // (s * 2) >= MIN_BLOCKS_PER_SPLIT:
        s *= 2
    return s


def check_shapes(x_shape, w_shape, x_dtype, w_dtype) -> None:
    """Raises ValueError with the reason when dense_matmul cannot take these operands."""
    if len(x_shape) != 2 or len(w_shape) != 2:
        raise ValueError(f"dense_matmul needs x [M, K] and w [N, K], got {x_shape} and {w_shape}")
    if x_shape[1] != w_shape[1]:
        raise ValueError(f"dense_matmul: x has K={x_shape[1]} but w [N, K] has K={w_shape[1]}")
    if x_dtype != w_dtype or not any(x_dtype == d for d in DTYPES):
        raise ValueError(f"dense_matmul needs x and w both bfloat16 or both float16, got {x_dtype} and {w_dtype}")
    block_k(x_shape[1])


def _kernel(x_ref, w_ref, o_ref, *, bk, n_k):
    """Program (column tile j, split s, row tile i): the fp32 sum over split s's n_k blocks of K, in order."""
    bm, bn = x_ref.shape[0], w_ref.shape[0]
    first = pl.program_id(1) * n_k

    def body(i, acc):
        k0 = pl.multiple_of((first + i) * bk, bk)
        w = w_ref[:, pl.ds(k0, bk)]  # [BN, BK]
        x = x_ref[:, pl.ds(k0, bk)]  # [BM, BK]
        # w @ x^T: the weights are the left operand whatever BM is (see the module docstring)
        return acc + jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bn, bm), jnp.float32))
    o_ref[...] = acc.T.astype(o_ref.dtype)  # one split: the result; several: this split's fp32 partial


def dense_matmul(x: jax.Array, w: jax.Array, *, interpret: bool = False, out_dtype=None) -> jax.Array:
    """y [M, N] = x [M, K] @ w[N, K]^T with fp32 accumulation, in x.dtype; row i is bitwise the same for every M.

    out_dtype (default x.dtype): the result's dtype; jnp.float32 returns the accumulator itself, whose bits show
    any change in the order of the additions (a bf16 result hides all but ~1 in 5000 of them)."""
    check_shapes(x.shape, w.shape, x.dtype, w.dtype)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bk, bm = block_k(k), block_m(m)
    m_pad = -(-m // bm) * bm
    n_pad = -(-n // N_ALIGN) * N_ALIGN
    bn = block_n(n_pad)
    splits = k_splits(k, n_pad)
    xp = x if m_pad == m else jnp.pad(x, ((0, m_pad - m), (0, 0)))
    wp = w if n_pad == n else jnp.pad(w, ((0, n_pad - n), (0, 0)))
    params = None
    if not interpret and pl_triton is not None:
        params = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    y = pl.pallas_call(
        functools.partial(_kernel, bk=bk, n_k=k // bk // splits),
        grid=(n_pad // bn, splits, m_pad // bm),
        in_specs=[pl.BlockSpec((bm, k), lambda j, s, i: (i, 0)), pl.BlockSpec((bn, k), lambda j, s, i: (j, 0))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda j, s, i: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, n_pad), out_dtype if splits == 1 else jnp.float32),
        interpret=interpret, compiler_params=params,
        name=f"dense_matmul_bm{bm}_bn{bn}_bk{bk}_s{splits}",
    )(xp, wp)
    y = y[0] if splits == 1 else fixed_order.pairwise_sum(y, axis=0).astype(out_dtype)
    return y[:m, :n] if (m_pad, n_pad) != (m, n) else y
