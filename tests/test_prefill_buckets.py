"""What `precompile` covers (issue 14 item 4, issue 18 item 1). Prefill buckets: chunks are cut to a few token
counts that `precompile` compiles, so a prompt of any length compiles nothing in its request (without them, a
prompt's shorter last chunk has a power-of-two bucket of its own: the H200 run's 4K prompt compiled for 91 s), and
the tokens stay the model's own. Sampling: the sampler of the parameters a server expects (its generation
defaults) is compiled too."""

import pytest

import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig, default_prefill_buckets
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams
from serving.cli import _buckets, default_sampling


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


def _engine(model, **kw):
    cfg = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, page_size=4, compile_ahead=False)
    return Engine(RealRunner(model, 0, max_model_len=128), EngineConfig(**(cfg | kw)))


def test_precompiled_buckets_cover_every_prompt_length(model):
    eng = _engine(model, prefill_buckets=(4, 16))
    assert {s[1] for s in eng.startup_shapes()} == {1, 4, 16}
    eng.precompile(progress=False)
    compiled = eng._steps.counters["compiled"]
    steps = []  # (T, each row's token count) of every launched step
    make_ticket = eng._make_ticket
    eng._make_ticket = lambda plans: steps.append(t := make_ticket(plans)) or t
    prompts = {"a": [(5 * i + 3) % 200 + 1 for i in range(23)], "b": [(7 * i + 1) % 200 + 1 for i in range(6)]}
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                outs[req.request_id] = list(req.output)
    assert eng._steps.counters["compiled"] == compiled  # prompts of 23 and 6 tokens, two rows: nothing compiled
    for rid, prompt in prompts.items():
        assert outs[rid] == model.generate(prompt, 9)
    rows = [(t.num_tokens, sorted(r.n for r in t.rows)) for t in steps]
    assert rows[0] == (16, [16])  # 'a' takes the whole budget in one bucket-sized chunk
    assert all(t in (1, 4, 16) for t, _ in rows)
    # every prefill chunk is a bucket, but for a rest shorter than the smallest (23 = 16 + 4 + 3; 6 = 4 + 2)
    chunks = [n for _, ns in rows for n in ns if n > 1]
    assert sorted(chunks) == [2, 3, 4, 4, 16]


def test_without_buckets_a_short_last_chunk_compiles(model):
    """The regression the buckets remove, shown on the same engine without them."""
    eng = _engine(model, max_num_seqs=1)
    eng.precompile(progress=False)
    compiled = eng._steps.counters["compiled"]
    eng.add_request("a", list(range(1, 24)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng._steps.counters["compiled"] > compiled  # the 7-token rest: bucket 8, not precompiled


def test_bucket_config(model):
    assert default_prefill_buckets(8192) == (512, 2048, 8192)
    assert _engine(model, prefill_buckets="auto").cfg.prefill_buckets == (4, 16)  # 16 // 16 = 1 is the decode step
    for bad, why in [((16, 4), "ascending"), ((4, 8), "largest"), ((1, 16), "exceed"), ("wide", "ascending"),
                     ((4.0, 16), "ascending")]:
        with pytest.raises(ValueError, match=why):
            _engine(model, prefill_buckets=bad)
    assert _buckets("auto") == "auto" and _buckets("512,2048,8192") == (512, 2048, 8192)
    with pytest.raises(Exception, match="comma-separated"):
        _buckets("512;2048")


def test_precompiled_sampling_variant(model):
    """The sampling variant of a server's defaults: precompile compiles its sampler at every row bucket (the model
    steps are the greedy ones: sampling does not change them)."""
    eng = _engine(model, max_num_seqs=1, prefill_buckets=(4, 16))
    expected = default_sampling({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 99})
    assert (expected.temperature, expected.top_p, expected.top_k) == (0.7, 0.8, 20)
    assert [k.sampling for k in eng.startup_samplers([expected])] == [("cap", True)]  # one row bucket
    eng.precompile(progress=False, sampling_params=[expected])
    compiled = eng._steps.counters["compiled"], eng._samplers.counters["compiled"]

    def run(params):
        eng.add_request(str(eng.step_id), [(3 * i + 2) % 200 + 1 for i in range(21)], params)
        while eng.has_unfinished():
            eng.step()
    run(SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=5, ignore_eos=True, seed=1))
    run(SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert (eng._steps.counters["compiled"], eng._samplers.counters["compiled"]) == compiled
    run(SamplingParams(temperature=0.7, max_tokens=2, ignore_eos=True, seed=1))  # no top-k / top-p: a sampler
    # of its own (device_sampling.mask_modes), and no model step
    assert eng._steps.counters["compiled"] == compiled[0] and eng._samplers.counters["compiled"] > compiled[1]


def test_warm_up_leaves_the_first_request_nothing_to_compile(model):
    """precompile compiles the model steps; warm_up (one throwaway full-chunk request) also compiles the store's
    own ops. After both, a prompt of full chunks with prefix caching on compiles no program at all (counted by
    jax's compile events, the model steps and the store ops alike), and its tokens are still the model's own:
    the warm-up request leaves nothing behind that a later request reads."""
    import jax

    eng = _engine(model, max_num_seqs=1, prefill_buckets=(16,), enable_prefix_caching=True, block_size=4)
    eng.precompile(progress=False)
    assert eng.warm_up() > 0 and not eng.requests and not eng.has_unfinished()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    prompt = [(5 * i + 3) % 200 + 1 for i in range(32)]  # two full chunks
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                out = list(req.output)
    assert compiles == []
    assert out == model.generate(prompt, 6)
    with pytest.raises(RuntimeError, match="before any request"):
        eng.warm_up()


def test_a_long_request_leaves_the_next_one_nothing_to_compile(model):
    """The store ops run at a few row counts (MAX_OP_ROWS per call), all compiled by warm_up: a request of many
    more pages than the warm-up's (26 pages against 4) releases them into the next request's first step, which
    then compiles nothing (a poison of 26 pages took a new power-of-two program before: the H200's first 32K
    request compiled 2 store ops in its TTFT)."""
    import jax

    eng = _engine(model, max_num_seqs=1, prefill_buckets=(16,))  # no prefix cache holding the pages
    eng.precompile(progress=False)
    eng.warm_up()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    outs = []
    for rid, n in (("long", 100), ("next", 9)):
        prompt = [(3 * i + 2) % 200 + 1 for i in range(n)]
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished():
            outs += [(list(req.output), prompt) for req in eng.step() if req.finished]
    assert compiles == []
    assert [o for o, _ in outs] == [model.generate(p, 4) for _, p in outs]
