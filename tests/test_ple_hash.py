"""PLE hashing checked against the release's stored constants and a direct, loop-by-loop recomputation."""

import numpy as np

from flashnext_jax.config import real_config
from flashnext_jax.ple import NgramHasher

SPEC_PRIMES = [20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077, 20000081, 20000093,
               20000107, 20000147, 20000153, 20000159, 20000161, 20000171]


def test_multipliers_and_head_sizes_match_the_release():
    h = NgramHasher(real_config())
    assert h.multipliers.tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert h.sizes.tolist() == SPEC_PRIMES
    assert h.total_rows == 320_001_446 and h.padded_rows == 320_001_536
    assert h.padded_rows // real_config().split_ngram_parts == 2_500_012


def direct_ids(h: NgramHasher, tokens: list[int]) -> np.ndarray:
    """Spec 3.3 written as plain Python ints: t_j(p) = token p-j if inside p's EOS segment, else EOS."""
    eos = h.eos
    out = []
    for p in range(len(tokens)):
        seg_start = 0
        for q in range(p):
            if tokens[q] == eos:
                seg_start = q + 1
        t = [tokens[p - j] if p - j >= seg_start else eos for j in range(3)]
        m = [int(x) for x in h.multipliers]
        mix2 = (t[0] * m[0]) ^ (t[1] * m[1])
        mix3 = mix2 ^ (t[2] * m[2])
        row = [mix2 % int(h.sizes[i]) + int(h.offsets[i]) for i in range(8)]
        row += [mix3 % int(h.sizes[i]) + int(h.offsets[i]) for i in range(8, 16)]
        out.append(row)
    return np.array(out, np.int64)


def test_ids_equal_direct_recomputation_with_eos_segments():
    h = NgramHasher(real_config())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 248320, 60).tolist()
    for i in (0, 7, 8, 30, 31, 59):
        tokens[i] = h.eos
    got = h.ids(h.initial_context(), np.array(tokens))
    np.testing.assert_array_equal(got, direct_ids(h, tokens))


def test_incremental_ids_with_carried_context_equal_one_shot():
    h = NgramHasher(real_config())
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 248320, 40)
    tokens[[5, 17, 18]] = h.eos
    whole = h.ids(h.initial_context(), tokens)
    ctx, parts = h.initial_context(), []
    for lo, hi in [(0, 3), (3, 4), (4, 18), (18, 19), (19, 40)]:
        parts.append(h.ids(ctx, tokens[lo:hi]))
        ctx = h.next_context(ctx, tokens[lo:hi])
    np.testing.assert_array_equal(np.concatenate(parts), whole)
