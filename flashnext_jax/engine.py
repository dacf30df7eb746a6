"""The engine loop: schedule -> tickets -> padded batch (row->slot map lives only in this step) -> jitted pure
model step `(params, store, batch) -> (store, outputs)` with the store donated (then, where a row needs more than
its argmax, the jitted sampler) -> (D steps later) sample + commit via the ticket. See docs/engine-design.md for
the model protocol and the invariants each test proves. Beside it: the batch and the runner's interface
(model_runner.py), the step's jitted programs and their keys (step_programs.py), the outputs as the host reads
them (host_outputs.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import random
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fixed_order
from pallas_kernels.kernel_switch import resolve_impl

from . import sampling, token_kinds
from .compile_ahead import abstract
from .device_sampling import LogitBias, SamplerInputs, SamplingInputs, device_sampled, mask_modes
from .host_outputs import HostOutputs, crossing_outputs
from .model_runner import HostRow, ModelRunner, PackedBatch
from .multihost import Agreement
from .page_pool import device_memory, size_pool
from .request_images import RequestImages, prompt_digest
from .scheduler import Request, RowPlan, Scheduler, SchedulerConfig, Status
from .state_store import StoreDims, StoreLedger, StoreSpec, _bucket
from .step_cache import StepCache
from .step_programs import SamplerKey, StepKey, chain_tokens, choose_tokens_packed, jitted_step
from .structured_output import GrammarCompiler, GrammarState, allowed_tokens
from .tickets import RowTicket, StepTicket, TokenSource
from .token_bans import TokenBans

log = logging.getLogger("flashnext_jax.engine")


def default_prefill_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """A chunk, a quarter and a sixteenth of it (8192 -> 512, 2048, 8192): a rest is cut into at most a few
    steps of these (a step reads every weight once: ~13 ms at the real size) and padded by less than 4x only
    below the smallest, so three prefill shapes cover every prompt."""
    c = max_num_batched_tokens
    return tuple(sorted({max(c // 16, 1), max(c // 4, 1), c}))


def _check_prefill_buckets(buckets: tuple[int, ...] | None, decode_tokens: int, max_num_batched_tokens: int):
    if buckets is None:
        return
    if isinstance(buckets, str) or not buckets or list(buckets) != sorted(set(buckets)) or \
            any(not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"prefill_buckets must be 'auto', None or ascending distinct positive token counts, "
                         f"got {buckets!r}")
    if buckets[-1] != max_num_batched_tokens:
        raise ValueError(f"the largest prefill bucket ({buckets[-1]}) must be max_num_batched_tokens "
                         f"({max_num_batched_tokens}): a chunk may use the whole budget")
    if buckets[0] <= decode_tokens:
        raise ValueError(f"prefill buckets must exceed the decode step's {decode_tokens} tokens, got {buckets}")


# --------------------------------------------------------------------------------------------------- the engine


class EngineDeadError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = False
    block_size: int = 16  # prefix-snapshot granularity
    page_size: int = 16  # KV page size
    num_pages: int | None = None  # default: sized from the device memory left (page_pool.py)
    gpu_memory_utilization: float = 0.9  # the fraction of device memory the engine may use (vLLM's meaning)
    num_slots: int | None = None  # default: max_num_seqs
    num_snapshots: int = 64
    pipeline_delay: int = 0  # D: a step's sample+commit runs D engine steps after it was launched
    max_rows_per_step: int | None = None  # a micro-batch's rows (pipeline: max_num_seqs over the stages)
    permute_rows: int | None = None  # seed: shuffle batch rows every step (tests)
    debug: bool = True  # shadow ownership ledger checks every write; stale writes raise
    min_batch_bucket: int = 1  # shape buckets: B and T are powers of two >= these (fewer compilations)
    min_token_bucket: int = 1
    # the token counts a prefill chunk is cut to (ascending, the largest = max_num_batched_tokens): a chunk takes
    # the largest that fits, a shorter rest is padded to the smallest, so every prompt's chunks run one of these
    # few step shapes, all compiled at startup. "auto": `default_prefill_buckets` (what `LLM(precompile=True)`
    # uses); None: any power of two (one compile per new bucket: cheap on the CPU, ~1-2 min per shape at the
    # real size)
    prefill_buckets: tuple[int, ...] | str | None = None
    min_pool_capacity: tuple = (1, 1, 1)  # device pools (slots, pages, snapshots) rounded up to >= these
    # compile the decode step for the next page-table width in the background while decoding at a width, so a
    # request whose context outgrows its width does not stall every request for a compile (compile_ahead.py)
    compile_ahead: bool = True
    # the step's page-table width: "bucket" (a power-of-two bucket of the pages the step touches: one compile per
    # bucket), "max" (always the widest, max_model_len's pages: one width, nothing compiles as a context grows),
    # "auto" ("max" where the runner says a padded width costs nothing, `runner.one_page_width`, else "bucket")
    page_table_width: str = "auto"
    # compiled model steps kept (least recently used dropped beyond): each maps ~1,000 memory regions, and
    # vm.max_map_count (65,530) ended a server that kept ~60 (step_cache.py)
    max_compiled_steps: int = 32
    # compiled samplers kept (choose_tokens): small programs, ~100 memory maps each on the CPU (a model step ~1,000)
    max_compiled_samplers: int = 64
    # a request's tokens and logits do not depend on what runs beside it (batch size, token bucket, chunk
    # boundaries): fixed-order reductions, one matmul path per weight, no excess precision (docs/batch-invariance.md).
    # None: fixed_order.default_mode() (on; on the GPU with token kinds, ~1.1x a decode step)
    batch_invariant: bool | None = None
    # the QSA layers' K/V pages in pinned host memory, fetched as the indexer selects them (qsa_offload.py): the
    # device keeps the indexer's keys only, for GPUs too small for the whole context's K/V
    qsa_kv_offload: bool = False
    # overlap the host with the device (vLLM's --async-scheduling): a decode row is launched while its request's
    # previous step is still in flight, its token taken from that step's device output (chain_tokens), so the
    # host commits step n and builds step n + 1 while the device runs. Needs a runner without MTP (k = 0) and
    # with `chained_host_inputs` (the n-gram table goes to the device), one process, no pipeline delay. Rows that
    # need the host between steps (host sampling, grammars, images, a prefix snapshot) commit before their next
    # step as without it; a row launched after its request's last token (EOS, stop string) is dropped unused.
    async_scheduling: bool = False
    # batch invariance at the GEMVs' speed (token_kinds.py): a request's generated tokens take the GEMV kernels
    # and its prompt tokens the tensor-core kernels, the scheduler keeping the two kinds in separate rows. None: on
    # where it changes a kernel (batch invariant on the Pallas kernels); True on the CPU's reference kernels gives
    # the scheduling alone (tests).
    token_kinds: bool | None = None


class Engine:
    def __init__(self, runner: ModelRunner, cfg: EngineConfig = EngineConfig(),
                 draft_hook: Callable[[Request, list[int]], list[int]] | None = None,
                 row_order: Callable[[int, list[str]], list[int]] | None = None,
                 grammar_compiler: GrammarCompiler | None = None):
        if not 0 <= cfg.pipeline_delay <= max(3, getattr(runner, "num_stages", 1)):
            raise ValueError("pipeline_delay must be in 0..max(3, pipeline stages)")
        if hasattr(runner, "pipeline_step"):  # compile-ahead lowers one jitted step; a pipeline has one per stage
            cfg = dataclasses.replace(cfg, compile_ahead=False)
        if cfg.batch_invariant is None:
            cfg = dataclasses.replace(cfg, batch_invariant=fixed_order.default_mode())
        if cfg.token_kinds is None:
            cfg = dataclasses.replace(cfg, token_kinds=cfg.batch_invariant and resolve_impl(None) != "reference")
        if cfg.token_kinds and not cfg.batch_invariant:
            raise ValueError("token_kinds needs batch_invariant (it is how a batch-invariant step keeps the GEMVs)")
        if cfg.qsa_kv_offload:
            if not hasattr(runner, "with_qsa_kv_offload"):
                raise ValueError(f"qsa_kv_offload: {type(runner).__name__} cannot keep QSA K/V pages in host memory "
                                 "(a RealRunner of one stage can)")
            runner = runner.with_qsa_kv_offload()
        if cfg.num_speculative_tokens > runner.k:
            raise ValueError(f"the model drafts at most {runner.k} tokens, asked for {cfg.num_speculative_tokens}")
        self._chain_params = None
        if cfg.async_scheduling:
            self._chain_params = self._set_up_async(runner, cfg)
        self.runner, self.draft_hook, self.row_order = runner, draft_hook, row_order
        mml = cfg.max_model_len or runner.max_model_len
        if mml > runner.max_model_len:
            raise ValueError(f"max_model_len {mml} exceeds the model's {runner.max_model_len}")
        slots = cfg.num_slots or cfg.max_num_seqs
        mp = -(-mml // cfg.page_size)
        self.K1 = runner.k + 1
        self._decode_tokens = _bucket(max(self.K1, cfg.min_token_bucket))
        # token kinds: the width of a generated row (its tokens sit in the first columns), 0 without kinds
        self._kinds_width = self._decode_tokens if cfg.token_kinds else 0
        if cfg.prefill_buckets == "auto":
            cfg = dataclasses.replace(cfg, prefill_buckets=tuple(
                b for b in default_prefill_buckets(cfg.max_num_batched_tokens) if b > self._decode_tokens) or None)
        _check_prefill_buckets(cfg.prefill_buckets, self._decode_tokens, cfg.max_num_batched_tokens)
        # stages in several processes (multihost.py): every process runs this loop, checked each step
        self._peers = Agreement() if getattr(runner, "multiprocess", False) else None
        pages = cfg.num_pages or self._size_pool(runner.store_spec(), cfg, slots, mml)
        if self._peers is not None:  # one pool size for all: the stores' shapes are in every step's key
            pages = self._peers.smallest(pages)
        self.cfg = dataclasses.replace(cfg, max_model_len=mml, num_pages=pages, num_slots=slots)
        self.max_pages_per_row = _bucket(mp)
        if cfg.page_table_width not in ("auto", "bucket", "max"):
            raise ValueError(f"page_table_width must be 'auto', 'bucket' or 'max', got {cfg.page_table_width!r}")
        self.one_width = cfg.page_table_width == "max" or (
            cfg.page_table_width == "auto" and bool(getattr(runner, "one_page_width", False)))
        self.ledger = StoreLedger(runner.store_spec(), StoreDims(slots, pages, cfg.page_size, cfg.num_snapshots,
                                                                 self.K1), debug=cfg.debug,
                                  min_capacity=cfg.min_pool_capacity, shardings=getattr(runner, "shardings", None))
        if self._peers is not None:
            self.ledger.track_ops()
        self.sched = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, mml,
                                               cfg.num_speculative_tokens, cfg.enable_prefix_caching,
                                               cfg.block_size, cfg.max_rows_per_step, cfg.prefill_buckets,
                                               self._prefill_align(runner, cfg), cfg.async_scheduling,
                                               self._kinds_width),
                               self.ledger)
        self._steps, self._samplers, self._ahead = jitted_step(runner, cfg.batch_invariant, cfg.token_kinds)
        self._steps.set_limit(cfg.max_compiled_steps)
        self._samplers.set_limit(cfg.max_compiled_samplers)
        # where a step's logits are (a pipeline's last stage): the samplers' inputs go there
        self._placement = getattr(runner, "output_sharding", None)
        # stages in several processes: the samplers run where the last stage's outputs are, and then only what the
        # host loops read crosses to the other processes (_share_outputs)
        self._multiprocess = getattr(runner, "multiprocess", False)
        self._outputs_here = getattr(runner, "holds_outputs", True)
        self._sampler_types: dict = {}  # (sampler key, logits types) -> its outputs' types (the receivers')
        self._crossings: dict = {}  # (step key, sampler key, host logits) -> the types that cross
        # the store's leaf shapes end every step key: engines of one runner with other pool sizes share the cache
        self._store_key = tuple(a.shape for a in jax.tree_util.tree_leaves(self.ledger.store))
        self.pending: collections.deque[tuple[StepTicket, Any]] = collections.deque()
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.dead: BaseException | None = None
        self._rng = random.Random(cfg.permute_rows) if cfg.permute_rows is not None else None
        self._arrivals = 0
        self.counters = collections.Counter()
        self._bug_row_addressed_commit = False  # mutation-test knob: reproduces the incident's addressing bug
        self._last_rows: list[tuple] = []
        self._widened: dict[StepKey, int] = {}  # decode keys _compile_next_width asked for -> evictions then
        self.grammar_compiler = grammar_compiler  # structured outputs (None: requests with a grammar are refused)
        self.grammars: dict[str, GrammarState] = {}  # request id -> its grammar state, while it runs

    def _set_up_async(self, runner: ModelRunner, cfg: EngineConfig):
        """Async scheduling (EngineConfig.async_scheduling): its conditions checked, its programs' cache made;
        -> the runner's device inputs for chained rows (placed before the KV pool is sized from the memory left)."""
        why = None
        if runner.k:
            why = ("a runner with MTP (k > 0): a verify step's accepted count, and with it the next row's position "
                   "and state column, is known only after its commit")
        elif cfg.pipeline_delay or hasattr(runner, "pipeline_step") or getattr(runner, "multiprocess", False):
            why = "pipeline stages (their steps already overlap through the pipeline delay)"
        elif not hasattr(runner, "chained_host_inputs"):
            why = f"{type(runner).__name__}, which cannot make a row's host inputs on the device (chained_host_inputs)"
        if why:
            raise ValueError(f"async scheduling is not available with {why}")
        # one compiled program per argument types (rows, previous rows, width, sampled or not), at most as many
        # as the samplers kept (step_cache.py: a jax.jit would keep every one it compiled)
        self._chains = StepCache(functools.partial(chain_tokens, runner.chained_host_inputs),
                                 cfg.max_compiled_samplers, donate_argnums=(), name="chain_tokens",
                                 log_level=logging.DEBUG, batch_invariant=cfg.batch_invariant)
        params = runner.place_chain_inputs()
        log.info("async scheduling: %.2f GB of chained-row inputs on the device",
                 sum(a.nbytes for a in jax.tree_util.tree_leaves(params)) / 1e9)
        return params

    def _size_pool(self, spec: StoreSpec, cfg: EngineConfig, slots: int, mml: int) -> int:
        pool = size_pool(spec, cfg.page_size, slots, cfg.num_snapshots, self.K1, mml, cfg.gpu_memory_utilization,
                         device_memory())
        tokens = pool.num_pages * cfg.page_size
        log.info("KV page pool: %s; at most %.2f concurrent sequences of max_model_len %d", pool.describe(
            cfg.page_size), tokens / mml, mml)
        if tokens < mml:
            log.warning("the KV page pool holds %d tokens, less than max_model_len %d: longer requests are refused",
                        tokens, mml)
        if pool.num_pages < 1:
            raise ValueError(f"no device memory left for the KV page pool ({pool.source}); lower the model size or "
                             f"raise gpu_memory_utilization ({cfg.gpu_memory_utilization})")
        return pool.num_pages

    # ---- compiling ahead of traffic
    def _prefill_align(self, runner: ModelRunner, cfg: EngineConfig) -> int:
        """The grid prompts are cut on (SchedulerConfig.prefill_align): the runner's, when batch invariant and the
        step budget can always reach the next grid point beside a full batch of decode rows."""
        align = getattr(runner, "prefill_align", 1) if cfg.batch_invariant else 1
        if align > 1 and cfg.max_num_batched_tokens < align + cfg.max_num_seqs * self.K1:
            log.warning("max_num_batched_tokens=%d is below %d + %d rows x %d tokens: prompts longer than %d tokens "
                        "are cut anywhere, so their chunks are not batch invariant", cfg.max_num_batched_tokens,
                        align, cfg.max_num_seqs, self.K1, align)
            return 1
        return align

    def _row_buckets(self) -> list[int]:
        """Every row bucket B a step of this engine can have (powers of two from min_batch_bucket)."""
        rows = _bucket(max(self.cfg.max_num_seqs, self.cfg.min_batch_bucket))
        first = _bucket(max(1, self.cfg.min_batch_bucket))
        return [1 << i for i in range(first.bit_length() - 1, rows.bit_length())]

    def decode_shapes(self) -> list[StepKey]:
        """The decode model steps this engine can launch (every row bucket x the decode token bucket x every
        page-table width): the steps that run at every width as contexts grow, so the ones precompiled."""
        widths = [1 << i for i in range(self.max_pages_per_row.bit_length()) if 1 << i <= self.max_pages_per_row]
        widths = widths[-1:] if self.one_width else widths
        return [StepKey(b, self._decode_tokens, w, False, self._store_key) for b in self._row_buckets() for w in widths]

    def startup_shapes(self) -> list[StepKey]:
        """The model steps `precompile` compiles by default: the decode steps, and with one page-table width also
        the prefill steps at every row bucket: every prefill bucket, so that no prompt's chunk compiles (without
        prefill_buckets only the full chunk, max_num_batched_tokens: a prompt's shorter last chunk then has a token
        bucket of its own that compiles on first use)."""
        keys = self.decode_shapes()
        if self.one_width:
            full = _bucket(max(min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len), self._decode_tokens))
            prefill = self.cfg.prefill_buckets or (full,)
            keys += [k._replace(tokens=t) for t in prefill if t > self._decode_tokens for k in self.decode_shapes()]
        return keys

    def startup_samplers(self, sampling_params: Sequence[sampling.SamplingParams] = ()) -> list[SamplerKey]:
        """The samplers requests of these parameters need (a server's generation defaults: what most of its
        requests sample with), at every row bucket: the key of a step whose token-choosing rows all have one of
        them (as _choose_tokens makes it from the step's inputs)."""
        keys = {self._sampler_key_of(p, b): None for p in sampling_params for b in self._row_buckets()}
        return [k for k in keys if k.needed]

    def _sampler_key_of(self, p: sampling.SamplingParams, b: int) -> SamplerKey:
        """The sampler key of a step of b rows whose token-choosing rows all have the parameters p."""
        masks = None
        if device_sampled(p, self.cfg.num_speculative_tokens):
            masks = mask_modes([max(p.top_k, 0)], [p.top_p]) + self._verify_columns()
        bias = LogitBias.width(len(p.logit_bias)) if p.logit_bias else 0
        return SamplerKey(b, masks, self._device_logprobs([p]), bias,
                          p.structured_outputs is not None or TokenBans.applies(p))

    def _verify_columns(self) -> tuple:
        """The verify form's part of a sampler key: (K1,) in an engine with MTP drafts, where device-sampled rows
        verify their drafts on the device (device_sampling.verify_tokens), else ()."""
        return (self.K1,) if self.cfg.num_speculative_tokens else ()

    def _host_samples(self, p: sampling.SamplingParams) -> bool:
        """Whether a row of p chooses its tokens on the host from the raw logits (and draft logits): neither the
        device's argmax nor a device sample (penalties, sampling with MTP drafts to verify; its logprobs too)."""
        return not p.device_argmax and not device_sampled(p, self.cfg.num_speculative_tokens)

    def _device_logprobs(self, params: Sequence[sampling.SamplingParams]) -> bool:
        """Whether some row wants the logprob of a token the device chooses (greedy without penalties, or sampled
        on the device); the host computes those of the tokens it samples from the logits (sampling.token_logprob)."""
        return any(p.logprobs is not None and (p.device_argmax or device_sampled(p, self.cfg.num_speculative_tokens))
                   for p in params)

    def precompile(self, shapes: Sequence[tuple] | None = None, progress: bool = True,
                   sampling_params: Sequence[sampling.SamplingParams] = ()) -> int:
        """Compile the model steps of `shapes` (StepKeys; default: startup_shapes()) and the samplers of
        `sampling_params` (startup_samplers) now, with a progress bar, so that requests of those shapes compile
        nothing (with JAX's persistent compilation cache configured, a restart reads them from disk). Returns how
        many programs were compiled."""
        from tqdm import tqdm

        keys = [StepKey(*s) for s in (self.startup_shapes() if shapes is None else shapes)]
        samplers = self.startup_samplers(sampling_params)
        for cache, n, what in ((self._steps, len(keys), "model steps"), (self._samplers, len(samplers), "samplers")):
            if n > cache.limit:
                log.warning("precompiling %d %s, more than the %d kept: keeping all of them", n, what, cache.limit)
                cache.set_limit(n)
        todo = [k for k in keys if k not in self._steps] + [k for k in samplers if k not in self._samplers]
        log.info("precompiling %d engine programs (%d compiled already)", len(todo),
                 len(keys) + len(samplers) - len(todo))
        t0 = time.perf_counter()
        for key in tqdm(todo, desc="compiling engine steps", unit=" programs", disable=not progress):
            if isinstance(key, StepKey):
                log.info("compiling the engine step for %s", key.describe())
                self._steps.compile(key, self._abstract_args(key))
            else:
                log.debug("compiling %s", key.describe())
                self._compile_sampler(key, keys)
        if self.cfg.async_scheduling:  # a chained decode step after a step of as many rows, sampled or not
            for key in keys:
                if key.tokens == self._decode_tokens:
                    self._compile_chains(key)
        if self._multiprocess:  # the outputs' collectives of these parameters' steps (a greedy step's: above)
            for key in keys:
                for p in sampling_params:
                    s = self._sampler_key_of(p, key.rows)
                    self.runner.output_send(self._crossing(key, s if s.needed else None, self._host_samples(p)))
        log.info("precompiled %d engine programs in %.1f s", len(todo), time.perf_counter() - t0)
        return len(todo)

    def _abstract_args(self, key: StepKey) -> tuple:
        """The model step's argument types for a key, built the way a step builds its arguments (so the types and
        device placements are the ones a real step of that key has)."""
        b, t = key.rows, key.tokens
        z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        batch = jax.device_put(PackedBatch.pack(np.full(b, -1, np.int32), z(b), z(b, t), z(b), z(b),
                                                np.full((b, key.page_table_width), -1, np.int32),
                                                self.runner.host_prepare([None] * b, t), z(b),
                                                self._kinds_width))
        targets = jax.device_put(z(b, t)) if key.prompt_logprobs else None
        return abstract(self.runner.params), abstract(self.ledger.store), abstract(batch), abstract(targets)

    def _compile_chains(self, key: StepKey):
        """The chain_tokens programs a decode step of `key` takes after a step of as many rows (greedy rows only,
        and with device-sampled ones), typed as the engine's calls are: the compiled model step's outputs."""
        b = key.rows
        _, _, batch, _ = self._abstract_args(key)
        argmax = self._steps.compile(key, self._abstract_args(key)).out_info[1]["logits_argmax"]
        src = jax.ShapeDtypeStruct((b, 3), jnp.int32)
        context = jax.ShapeDtypeStruct((b, self.runner.chain_context_len), jnp.int32)
        for sample in (None, argmax):
            self._run_chain((abstract(self._chain_params), batch, argmax, sample, src, context), compile_only=True)

    def _compile_sampler(self, key: SamplerKey, model_keys: Sequence[StepKey]):
        """Compile a sampler for the logits of a model step of its rows: their types, placement included, are that
        compiled step's outputs (a key's executable must take what the engine's calls give it). Only the model step
        in a process without a pipeline's last stage (the samplers run in that stage's process)."""
        model = next((k for k in model_keys if k.rows == key.rows), None) or next(
            k for k in self.decode_shapes() if k.rows == key.rows)
        out = self._steps.compile(model, self._abstract_args(model)).out_info[1]
        if self._outputs_here:
            self._samplers.compile(key, (out["logits"], out["draft_logits"], abstract(
                self._on_last_stage(self._sampler_inputs_like(key))), key.logprobs))

    def _sampler_inputs_like(self, key: SamplerKey):
        """Sampler inputs (host arrays) of the types a step of `key` packs."""
        b, v = key.rows, self.runner.vocab_size
        z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        inputs = None
        if key.sampling is not None:
            columns = key.sampling[2] if len(key.sampling) > 2 else 0
            inputs = SamplingInputs(np.ones(b, np.float32), z(b), np.ones(b, np.float32), np.zeros(b, np.float32),
                                    np.zeros((b, columns, 2) if columns else (b, 2), np.uint32), *key.sampling,
                                    drafts=z(b, columns) if columns else None)
        width = key.logit_bias_width
        bias = LogitBias(z(b, width), np.zeros((b, width), np.float32)) if width else None
        mask = z(b, self.K1, -(-v // 32)) if key.grammar else None
        return SamplerInputs.pack(inputs, bias, mask)

    def _crossing(self, key: StepKey, skey: SamplerKey | None, host_logits: bool) -> dict:
        """The types of the outputs of a step of `key` with the sampler `skey` (None: none ran) that the other
        processes' host loops read (crossing_outputs); the same in every process."""
        hit = self._crossings.get((key, skey, host_logits))
        if hit is not None:
            return hit
        programs = self._steps.get(key) or self._steps.compile(key, self._abstract_args(key))
        out = dict(programs.out_info[1])
        if skey is not None:
            sig = (skey, out["logits"].shape, out["draft_logits"].shape)
            if sig not in self._sampler_types:  # traced, not compiled
                inputs = abstract(self._sampler_inputs_like(skey))
                self._sampler_types[sig] = jax.eval_shape(
                    lambda lg, dl, i: choose_tokens_packed(lg, dl, i, skey.logprobs), out["logits"],
                    out["draft_logits"], inputs)
            out |= self._sampler_types[sig]
        self._crossings[(key, skey, host_logits)] = crossing = crossing_outputs(out, host_logits)
        return crossing

    def _on_last_stage(self, tree):
        """Where a step's logits are (a pipeline's last stage, else the default device): the samplers' inputs."""
        return jax.device_put(tree, self._placement)

    def warm_up(self, decode_steps: int = 2) -> float:
        """Run one throwaway request now, before traffic: a prompt of the full prefill chunk, then `decode_steps`
        tokens. `precompile` compiles the model steps, but the first request still paid for the store's own ops
        (allocation, release, snapshots: small jitted programs compiled on first use) and for the first launch of
        each program (H200: the first 32K request 3.60 s vs 3.09 s the second time, issue 14); vLLM's startup dummy
        run serves the same purpose. The request's slot and pages are released as any finished request's; with
        prefix caching its snapshots stay as correct entries of its own prompt and age out. Returns seconds."""
        if self.requests or self.has_unfinished():
            raise RuntimeError("warm_up runs before any request (it would share their steps)")
        full = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len - decode_steps - 1)
        prompt = [(7 * i + 1) % self.runner.vocab_size for i in range(max(2, full))]
        t0 = time.perf_counter()
        log.info("warming up: one request of %d prompt tokens and %d decode steps", len(prompt), decode_steps)
        self.add_request("flashnext-warm-up", prompt, sampling.SamplingParams(
            temperature=0.0, max_tokens=decode_steps, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        del self.requests["flashnext-warm-up"]
        self.ledger.flush()  # the release of its slot and pages, queued for the next step: not the first request's
        self.ledger.warm_ops()
        log.info("warmed up in %.1f s", time.perf_counter() - t0)
        return time.perf_counter() - t0

    # ---- requests
    def add_request(self, request_id: str, prompt: Sequence[int], params: sampling.SamplingParams | None = None,
                    stop_checker=None, images=None) -> Request:
        """images: the prompt's api.ImageInput (the prompt holds their expanded pads, api.Model.image_prompt), whose
        vision tower runs here, or what `encode_images` made of them for this prompt; the rows stay with the
        request."""
        self._alive()
        if request_id in self.requests and not self.requests[request_id].finished:
            raise ValueError(f"duplicate request id {request_id!r}")
        params = params or sampling.SamplingParams()
        prompt = [int(t) for t in prompt]
        bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:5]} outside vocab [0, {self.runner.vocab_size})")
        for field, ids in (("logit_bias", params.logit_bias or ()),
                           ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("bad_words", [t for w in params.bad_words_token_ids or () for t in w])):
            bad = [t for t in ids if t >= self.runner.vocab_size]
            if bad:
                raise ValueError(f"request {request_id}: {field} token ids {bad[:5]} outside vocab "
                                 f"[0, {self.runner.vocab_size})")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError(f"request {request_id}: bad_words need a tokenizer (SamplingParams."
                             "with_bad_words_tokenized, or bad_words_token_ids)")
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError(f"request {request_id}: structured outputs need a tokenizer (this engine has none)")
            grammar = self.grammar_compiler.new_state(params.structured_outputs)  # ValueError: a bad spec
        req = Request(request_id, prompt, params.with_defaults(), self._arrivals, stop_checker=stop_checker)
        req.bans = TokenBans.of(params, self.runner.vocab_size, self.runner.eos_token_id)
        if images is not None:
            if not isinstance(images, RequestImages):
                images = self.encode_images(request_id, prompt, images)
            elif images.prompt != prompt_digest(prompt):
                raise ValueError(f"request {request_id}: its images were encoded for another prompt")
            req.images = images
            req.slot_values = self.runner.image_slot_values(req.images)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt)  # entry 0 stays None: the first token has no context
        if params.structured_outputs is not None:
            self.grammars[request_id] = grammar
        req.metrics["arrival_time"] = time.monotonic()
        self._arrivals += 1
        self.sched.add(req)
        self.requests[request_id] = req
        return req

    def encode_images(self, request_id: str, prompt: Sequence[int], images) -> RequestImages:
        """The vision tower over a prompt's images (api.ImageInput), for `add_request`. It reads the weights and
        nothing of the engine's state, so a server calls it on a worker thread without the engine's lock: a large
        image then stalls neither the event loop nor the steps of the requests in flight (llm.LLM.stream)."""
        if not hasattr(self.runner, "encode_images"):
            raise ValueError(f"request {request_id}: this model takes no images")
        return self.runner.encode_images([int(t) for t in prompt], images)  # ValueError: pads and images disagree

    def abort(self, request_id: str):
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.sched.finish(req, "abort")
            self.ledger.flush()
            self.grammars.pop(request_id, None)

    def free_request(self, request_id: str):
        """Forget a finished request: its record (prompt, output, logprobs, metrics) is dropped once the caller has
        its output, so a long-running server holds only live requests (its slot and pages were released when it
        finished). A request still in a step in flight (aborted mid-step) is dropped when that step commits."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.finished:
            raise ValueError(f"request {request_id!r} is still running: abort it first")
        self.grammars.pop(request_id, None)
        if req.inflight:
            req.freed = True
        else:
            del self.requests[request_id]

    @property
    def peers(self) -> Agreement | None:
        """The other processes' engines, when the stages live in several (multihost.py; None in one process): a
        server shares its inputs with them through it (serving/multiprocess.py)."""
        return self._peers

    def has_unfinished(self) -> bool:
        return self.sched.has_work() or any(i is not None for i in self.pending)

    # ---- one engine step
    def step(self) -> list[Request]:
        self._alive()
        try:
            return self._step_inner()
        except BaseException as e:  # engine fault: fail every in-flight request visibly
            self._fail_all(e)
            if self._peers is not None:  # and the other processes' engines with it
                self._peers.failed(e)
            raise

    def _step_inner(self) -> list[Request]:
        plans = self.sched.schedule()
        updated: list[Request] = []
        if plans:
            ticket = self._make_ticket(plans)
            batch = self._build_batch(ticket)
            if self.cfg.debug:
                self._check_writes(ticket)
            self.ledger.flush()  # admissions (reset / restore / COW) land before the step reads them
            targets = self._prompt_targets(ticket)
            key = StepKey(ticket.batch_size, ticket.num_tokens, batch.page_table_width, targets is not None,
                          self._store_key, "image_rows" in batch.host)
            if self._peers is not None:  # the same ticket and store ops as process 0's, or every process stops
                self._peers.agree(self.step_id, ticket, self.ledger.op_digest())
            store, out = self._launch_model_step(key, (self.runner.params, self.ledger.store, batch, targets))
            self.ledger.store = store
            sampler, chosen = self._choose_tokens(ticket, out)
            if out is not None:
                out |= chosen
            if self._multiprocess:
                out = self._share_outputs(ticket, key, sampler, out)
            if self._peers is not None:
                self._peers.launched()
            self.pending.append((ticket, out))
            self.counters["steps"] += 1
            chains = self._set_chains(ticket) if self.cfg.async_scheduling else False
            if self.cfg.compile_ahead:
                self._compile_next_width(key, batch, targets)
        elif self.pending:
            if not self.cfg.async_scheduling:  # (async: the step in flight commits below, nothing to advance)
                self.pending.append(None)  # a pipeline bubble: nothing launched, the pipe still advances
                self.counters["bubbles"] += 1
        elif self.sched.waiting and not self.sched.running:
            raise RuntimeError(f"cannot admit request {self.sched.waiting[0].request_id!r}: not enough free "
                               f"pages/slots even with an idle engine (pool too small for its prompt?)")
        self.step_id += 1
        # async scheduling: the step just launched stays uncommitted while every row of it may chain (its commit
        # then runs while the device computes the next step); otherwise everything commits now
        delay = (1 if plans and chains else 0) if self.cfg.async_scheduling else self.cfg.pipeline_delay
        while len(self.pending) > delay:
            item = self.pending.popleft()
            if item is not None:
                updated += self._commit(*item)
        while self.pending and all(i is None for i in self.pending):
            self.pending.clear()
        self.ledger.flush()
        return updated

    def _launch_model_step(self, key: StepKey, args: tuple):
        """Run the model step of `key` (a new key compiles first: logged, about a minute at the real size)."""
        if self._ahead.wait(key):
            log.info("waited for the background compile of the engine step for %s", key.describe())
        new = key not in self._steps
        if new:
            log.debug("new model step key: %s", key.components())
            log.info("compiling the engine step for %s (once per shape; about a minute at the real model size)",
                     key.describe())
            t0 = time.perf_counter()
        store, out = self._steps.call(key, args)
        if new:
            self.counters["compiles"] += 1
            log.info("engine step for %s compiled and launched in %.1f s", key.describe(), time.perf_counter() - t0)
        return store, None if out is None else dict(out)

    def _share_outputs(self, t: StepTicket, key: StepKey, sampler: SamplerKey, out: dict | None) -> dict:
        """Stages in several processes: the outputs the host loops read, from the last stage's process to every
        process (pipeline.PipelineRunner.share_outputs): the few-byte ones (argmax, finite flags, the sampler's),
        and the raw logits only in a step where some row samples on the host; decided from the ticket, the same in
        every process."""
        host_logits = any(r.samples and self._host_samples(self.requests[r.request_id].params) for r in t.rows)
        skey = sampler if sampler.needed else None
        return self.runner.share_outputs(out, self._crossing(key, skey, host_logits))

    def _choose_tokens(self, t: StepTicket, out: dict | None) -> tuple[SamplerKey, dict]:
        """-> (the step's sampler key, the sampler's outputs for the step's rows: device samples, logprobs, biased
        or masked argmax; empty when every token-choosing row is greedy without them: those commit from the model
        step's argmax). With stages in several processes it runs in the last stage's process only (`out` None
        elsewhere; the inputs are still made in every process: the grammar masks set each constrained row's step
        mask, and every process needs the key to know what crosses)."""
        params = [self.requests[r.request_id].params for r in t.rows if r.samples]
        # (the grammar masks also set each constrained row's step mask, which the host samples under)
        inputs, bias, mask = self._sampling_inputs(t), self._logit_bias(t), self._token_masks(t)
        key = SamplerKey(t.batch_size, None if inputs is None else inputs.masks, self._device_logprobs(params),
                         0 if bias is None else bias.ids.shape[1], mask is not None)
        if not key.needed or out is None:
            return key, {}
        if key not in self._samplers:
            log.debug("new sampler key: %s", key.components())
            self.counters["sampler_compiles"] += 1
        packed = SamplerInputs.pack(inputs, bias, mask)  # one host->device copy for all of them
        return key, self._samplers.call(key, (out["logits"], out["draft_logits"], self._on_last_stage(packed),
                                              key.logprobs))

    def _set_chains(self, t: StepTicket) -> bool:
        """After launching step t: mark each request whose next decode row may take its token from this step's
        device output (Request.chain, which the scheduler's _plan_chained reads). -> whether every row may."""
        every = True
        for r in t.rows:
            req = self.requests[r.request_id]
            p = req.params
            sampled = device_sampled(p, 0)
            ok = (r.samples and r.capture is None and not req.finished and req.images is None
                  and r.request_id not in self.grammars and (p.device_argmax or sampled)
                  and (req.bans is None or not req.bans.needed(len(req.output) + 1)))  # (the next row's masks)
            req.chain = TokenSource(t.step_id, r.row, r.n - 1 - r.base, sampled, r.start + r.n) if ok else None
            every = every and ok
        return every

    def _compile_next_width(self, key: StepKey, batch: PackedBatch, targets):
        """After a decode step at page-table width W: have the same model step at width 2W compiled in the
        background (once per key), so that it is ready when a row's context outgrows W. Only the model step: a
        sampler does not depend on the width."""
        if key.tokens > self._decode_tokens or key.page_table_width >= self.max_pages_per_row:
            return
        # asked once per key (a request costs ~20 us, on every decode step), again after the cache dropped a step
        evicted = self._steps.counters["evicted"]
        if self._widened.get(key) == evicted:
            return
        self._widened[key] = evicted
        wider = key._replace(page_table_width=min(2 * key.page_table_width, self.max_pages_per_row))

        def args():  # as the engine calls it
            return (abstract(self.runner.params), abstract(self.ledger.store),
                    batch.abstract_at_width(wider.page_table_width), abstract(targets))
        if self._ahead.request(wider, args, wider.describe()):
            self.counters["compiles_ahead"] += 1

    def _make_ticket(self, plans: list[RowPlan]) -> StepTicket:
        order = list(range(len(plans)))
        if self._rng is not None:
            self._rng.shuffle(order)
        if self.row_order is not None:
            order = list(self.row_order(self.step_id, [p.request.request_id for p in plans]))
            assert sorted(order) == list(range(len(plans)))
        rows = []
        for row, i in enumerate(order):
            p = plans[i]
            req = p.request
            self.ledger.begin_inflight(req.slot)
            req.inflight += 1
            req.metrics["num_steps"] += 1
            rows.append(RowTicket(req.request_id, req.slot, row, p.start, p.tokens, p.num_drafts, p.samples,
                                  max(len(p.tokens) - self.K1, 0), tuple(req.pages), p.capture, p.token_from))
        B = _bucket(max(len(rows), self.cfg.min_batch_bucket))
        n = max(r.n for r in rows)
        if self.cfg.token_kinds and any(p.start < len(p.request.prompt) for p in plans):
            n = max(n, self._decode_tokens + 1)  # a decode-shaped step runs every row as generated tokens
        return StepTicket(self.step_id, tuple(rows), B, self._token_bucket(n))

    def _token_bucket(self, n: int) -> int:
        """A step's token bucket T for its longest row of n tokens: the decode bucket (1 token, or 1 + the MTP
        drafts: the steps that run at every width as a context grows, so the ones compiled ahead), else the smallest
        prefill bucket holding n (a power of two without prefill_buckets)."""
        if n <= self._decode_tokens:
            return self._decode_tokens
        buckets = self.cfg.prefill_buckets
        return next(b for b in buckets if b >= n) if buckets else _bucket(n)

    def _build_batch(self, t: StepTicket) -> PackedBatch:
        B, T = t.batch_size, t.num_tokens
        ps = self.ledger.dims.page_size  # page-table width: a power-of-two bucket of the pages this step touches
        MP = self.max_pages_per_row if self.one_width else \
            min(self.max_pages_per_row, _bucket(max(-(-(r.start + r.n) // ps) for r in t.rows)))
        slot = np.full(B, -1, np.int32)
        gen = np.zeros(B, np.int32)
        tokens = np.zeros((B, T), np.int32)
        n_valid = np.zeros(B, np.int32)
        start = np.zeros(B, np.int32)
        pt = np.full((B, MP), -1, np.int32)
        generated = np.zeros(B, np.int32)
        host_rows: list[HostRow | None] = [None] * B
        chained = []
        for r in t.rows:
            req = self.requests[r.request_id]
            slot[r.row], gen[r.row] = r.slot.slot, r.slot.gen
            n_valid[r.row], start[r.row] = r.n, r.start
            generated[r.row] = r.start >= len(req.prompt)
            pt[r.row, : min(len(r.pages), MP)] = r.pages[:MP]
            if r.token_from is not None:  # its token is on the device: chain_tokens fills it in, and its host inputs
                chained.append(r)
                continue
            tokens[r.row, : r.n] = r.tokens
            host_rows[r.row] = HostRow(tuple(req.token_slice(max(0, r.start - 8), r.start)), r.start, r.tokens,
                                       req.images)
        self._last_rows = [(int(s), int(g)) for s, g in zip(slot, gen)]
        host = self.runner.host_prepare(host_rows, T)
        # one device_put, and the integers packed in one array: seven separate transfers cost ~1.2 ms per step on
        # the H200 host (bench/results/engine_host_profile.json)
        batch = jax.device_put(PackedBatch.pack(slot, gen, tokens, n_valid, start, pt, host, generated,
                                                self._kinds_width))
        return self._chain_batch(batch, chained) if chained else batch

    def _chain_batch(self, batch: PackedBatch, rows: list[RowTicket]) -> PackedBatch:
        """The chained rows' tokens (and the host inputs made from them) from the previous step's device outputs."""
        self.counters["chained_rows"] += len(rows)
        prev_ticket, prev_out = self.pending[-1]
        src = np.full((batch.ints.shape[0], 3), -1, np.int32)
        C = self.runner.chain_context_len
        context = np.full((batch.ints.shape[0], C), -1, np.int32)
        for r in rows:
            s = r.token_from
            assert s.step_id == prev_ticket.step_id and s.position == r.start, (s, prev_ticket.step_id, r.start)
            src[r.row] = (s.row, s.col, int(s.sampled))
            if C:
                before = self.requests[r.request_id].token_slice(max(0, r.start - C), r.start)
                context[r.row, C - len(before):] = before
        return self._run_chain((self._chain_params, batch, prev_out["logits_argmax"], prev_out.get("logits_sample"),
                                src, context))

    def _run_chain(self, args: tuple, compile_only: bool = False):
        """chain_tokens on `args` (arrays, or their types with compile_only), compiled once per argument types."""
        types = abstract(args)  # as jit sees them: the sharding only of arrays committed to a device
        key = ("chain_tokens", jax.tree_util.tree_structure(types), tuple(
            (a.shape, a.dtype, a.sharding) for a in jax.tree_util.tree_leaves(types)))
        with jax.enable_x64(True):  # the n-gram hash's 64-bit products
            if compile_only:
                return self._chains.compile(key, args)
            if key not in self._chains:
                self.counters["chain_compiles"] += 1
                log.debug("new chain_tokens key: %s", key[2])
            return self._chains.call(key, args)

    def _sampling_inputs(self, t: StepTicket) -> SamplingInputs | None:
        """Rows whose token this step samples on the device, with the index of that output token (fixed until the
        ticket commits: at most one step per request is in flight); None when no row does."""
        rows: list = [None] * t.batch_size
        k = self.cfg.num_speculative_tokens
        for r in t.rows:
            req = self.requests[r.request_id]
            if r.samples and device_sampled(req.params, k):  # a chained row's token follows its in-flight one
                rows[r.row] = (req.params, len(req.output) + (r.token_from is not None))
                if k:  # the verify form: the column of the row's last known token and the drafts after it
                    first = r.n - 1 - r.num_drafts
                    rows[r.row] += (first - r.base, r.tokens[first + 1:])
        if not any(rows):
            return None
        if k:
            return SamplingInputs.for_verify_rows(rows, t.batch_size, self.K1)
        return SamplingInputs.for_rows(rows, t.batch_size)

    def _logit_bias(self, t: StepTicket) -> LogitBias | None:
        """The logit_bias of the rows that choose a token this step (None when none has one)."""
        biases: list = [None] * t.batch_size
        for r in t.rows:
            if r.samples:
                biases[r.row] = self.requests[r.request_id].params.logit_bias
        return LogitBias.for_rows(biases, t.batch_size)

    def _prompt_targets(self, t: StepTicket) -> jax.Array | None:
        """[B, T] the prompt token after each row position of the requests that ask for prompt logprobs (-1 where
        none: padding, other rows, positions past the prompt); None when no row needs one."""
        targets = np.full((t.batch_size, t.num_tokens), -1, np.int32)
        for r in t.rows:
            req = self.requests[r.request_id]
            if req.params.prompt_logprobs is not None:
                after = req.prompt[r.start + 1: r.start + 1 + r.n]
                targets[r.row, : len(after)] = after
        return jax.device_put(targets) if np.any(targets >= 0) else None

    def _token_masks(self, t: StepTicket):
        """The token masks of this step's token-choosing rows that have a grammar or bans (token_bans.py): [B, K1,
        words] int32 numpy (column of the row's last known token, then one per draft; -1 words elsewhere), or None
        when no row has one (no mask code then). A row's grammar masks and its bans are ANDed; each such row keeps
        its columns' masks as `Request.step_mask` for the host-sampled paths. Computed on the host after the model
        step's launch (it needs them only in the sampler); a request has at most one step in flight, so its matcher
        and output hold its committed tokens here (docs/structured-output.md: where this could overlap the device
        more)."""
        grammar_rows, masked = [], []
        for r in t.rows:
            req = self.requests[r.request_id]
            req.step_mask = None
            state = self.grammars.get(r.request_id)
            if state is not None:
                state.step_mask = None
            if not r.samples:
                continue
            first = r.n - 1 - r.num_drafts  # offset of the last known token; the drafts follow it
            at, drafts = r.row * self.K1 + first - r.base, r.tokens[first + 1:]
            # (a chained row's token follows one not yet in req.output: _set_chains chains only rows no ban can reach)
            bans = None if req.bans is None or r.token_from is not None else req.bans.column_masks(req.output, drafts)
            if state is not None and state.active:
                grammar_rows.append((state, at, drafts))
            elif bans is None:
                continue
            masked.append((req, at, len(drafts) + 1, bans))
        if not masked:
            return None
        n = t.batch_size * self.K1
        mask = self.grammar_compiler.fill_masks(grammar_rows, n) if grammar_rows else np.full(
            (n, (self.runner.vocab_size + 31) // 32), -1, np.int32)
        for req, at, columns, bans in masked:
            if bans is not None:
                mask[at: at + columns] &= bans
            req.step_mask = mask[at: at + columns].copy()
        return mask.reshape(t.batch_size, self.K1, -1)

    def _check_writes(self, t: StepTicket):
        """Shadow ownership ledger: every slot and page this step writes is exclusively the row's own."""
        seen_slots, seen_pages = set(), set()
        ps = self.ledger.dims.page_size
        for r in t.rows:
            self.ledger.check(r.slot, owner=r.request_id)
            assert r.slot.slot not in seen_slots, "two rows share a slot"
            seen_slots.add(r.slot.slot)
            for blk in range(r.start // ps, (r.start + r.n - 1) // ps + 1):
                p = r.pages[blk]
                self.ledger.check_page_writable(p, r.request_id)
                assert p not in seen_pages, "two rows write one page"
                seen_pages.add(p)

    # ---- deferred work: consumes only the ticket and its own step's outputs
    def _commit(self, ticket: StepTicket, out) -> list[Request]:
        host = HostOutputs(out)
        updated = []
        for r in ticket.rows:
            req = self.requests[r.request_id]
            self.ledger.end_inflight(r.slot)
            req.inflight -= 1
            if req.chain is not None and req.chain.step_id == ticket.step_id:
                req.chain = None  # committed: its next row is planned from the host's tokens again
            if req.finished:  # aborted while this step was in flight, or a chained row after its last token
                self.sched.retire(req)
                if req.freed and not req.inflight:
                    del self.requests[r.request_id]
                if r.token_from is None:  # (a chained row after the last token: its request was reported already)
                    updated.append(req)
                continue
            ref = r.slot
            if self._bug_row_addressed_commit:  # the incident: address state by the row of the *latest* batch
                from .state_store import SlotRef
                s, g = self._last_rows[r.row] if r.row < len(self._last_rows) else (-1, 0)
                ref = SlotRef(s, g) if s >= 0 else r.slot
                self.ledger.debug = False
            self._commit_row(req, r, ref, host)
            if req.finished:
                self.grammars.pop(req.request_id, None)
            updated.append(req)
        self.counters["commits"] += 1
        return updated

    def _commit_row(self, req: Request, r: RowTicket, ref, host: HostOutputs):
        if req.params.prompt_logprobs is not None:
            self._commit_prompt_logprobs(req, r, host)
        new_tokens: list[int] = []
        token_cols: list[int] = []  # the logits column each new token was chosen from (for its logprob)
        on_device = req.params.device_argmax  # greedy without penalties: the device's argmax is the token
        sampled_on_device = False
        grammar = self.grammars.get(req.request_id)
        if not r.samples:
            accepted_inputs = r.n
        else:
            nd = r.num_drafts
            first = r.n - 1 - nd  # offset of the last known token
            cols = [first + i - r.base for i in range(nd + 1)]
            drafts = list(r.tokens[first + 1:])
            if on_device:
                m, new_tokens = sampling.verify_argmax(host["logits_argmax"][r.row, cols],
                                                       host["logits_finite"][r.row, cols], drafts, req.request_id)
            elif device_sampled(req.params, self.cfg.num_speculative_tokens):
                m, new_tokens = sampling.verify_sampled(
                    host["logits_sample"][r.row, cols], host["logits_accept"][r.row, cols] if nd else (),
                    host["logits_finite"][r.row, cols], drafts, req.request_id)
                sampled_on_device = True
            else:
                allowed = None if req.step_mask is None else allowed_tokens(req.step_mask, self.runner.vocab_size)
                m, new_tokens = sampling.verify(host["logits"][r.row, cols], drafts, req.draft_probs[:nd],
                                                req.params, req.tokens, len(req.output), req.request_id, allowed)
            accepted_inputs = first + 1 + m
            token_cols = cols[: len(new_tokens)]  # accepted drafts, then the bonus / resampled token
            req.metrics["num_drafts"] += nd
            req.metrics["num_accepted"] += m
            self.counters["drafts"] += nd
            self.counters["accepted"] += m
        col = accepted_inputs - 1 - r.base
        self.ledger.set_cursor(ref, col)
        if r.capture is not None and r.capture.offset < accepted_inputs:
            seq = req.tokens + new_tokens
            self.ledger.publish(ref, r.capture.offset - r.base, seq[: r.capture.length], r.pages, req.request_id,
                                req.prefix_salt(r.capture.length))
        req.num_computed = r.start + accepted_inputs
        if not new_tokens:  # a prefill chunk: drafts kept across a preemption stay pending
            return
        req.drafts, req.draft_probs = [], []
        if "first_token_time" not in req.metrics:
            req.metrics["first_token_time"] = time.monotonic()
        n_top = req.params.logprobs
        for t, c in zip(new_tokens, token_cols, strict=True):
            req.output.append(t)
            if n_top is not None:
                req.logprobs.append(self._token_logprob(host, r.row, c, t, n_top, on_device, sampled_on_device))
            reason = self._stop_reason(req, t)
            if grammar is not None:
                grammar.commit([t], req.request_id)
                reason = reason or ("stop" if grammar.done else None)  # complete: nothing but EOS could follow
            if reason:
                self.sched.finish(req, reason)
                req.metrics["finish_time"] = time.monotonic()
                return
        nd = min(self.cfg.num_speculative_tokens, host.shape("draft_logits_argmax")[2])
        if nd:
            if on_device or sampled_on_device:  # greedy drafts (the verify form's q is one-hot)
                drafts, probs = sampling.propose_argmax(host["draft_logits_argmax"][r.row, col, :nd],
                                                        host["draft_logits_finite"][r.row, col, :nd], req.request_id)
            elif (grammar is not None and grammar.active) or (
                    req.bans is not None and req.bans.needed(len(req.output))):
                drafts, probs = self._propose_restricted(req, grammar, host["draft_logits"][r.row, col, :nd])
            else:
                drafts, probs = sampling.propose(host["draft_logits"][r.row, col, :nd], req.params, len(req.output),
                                                 req.request_id)
            if self.draft_hook is not None:
                hooked = list(self.draft_hook(req, list(drafts)))[:nd]
                probs = [p if h == d else None for h, d, p in zip(hooked, drafts, probs)]
                drafts = hooked
            req.drafts, req.draft_probs = list(drafts), list(probs)

    def _propose_restricted(self, req: Request, grammar: GrammarState | None, draft_logits: np.ndarray):
        """Host-drawn drafts of a request with a grammar or bans, each from the draft head's distribution restricted
        to what the grammar (after the drafts before it) and the bans (at its output index, after the output and
        the drafts before it) allow, so q (used by rejection sampling) is the distribution drafted from."""
        probs, drafts = [], []

        def propose_one(i: int, allowed: np.ndarray | None) -> int:
            if req.bans is not None:
                free = req.bans.allowed_after(req.output, drafts[:i])
                allowed = free if allowed is None else allowed & free
            (d,), (q,) = sampling.propose(draft_logits[i: i + 1], req.params, len(req.output) + i, req.request_id,
                                          allowed[None])
            probs.append(q)
            drafts.append(d)
            return d
        if grammar is not None and grammar.active:
            return self.grammar_compiler.draft_masks(grammar, propose_one, len(draft_logits)), probs
        for i in range(len(draft_logits)):
            propose_one(i, None)
        return drafts, probs

    @staticmethod
    def _commit_prompt_logprobs(req: Request, r: RowTicket, host: HostOutputs):
        """Prompt positions r.start + 1 .. of this row: the logprob of each prompt token given those before it
        (entries are set by position: a recompute after a preemption writes the same entries again)."""
        n_top = req.params.prompt_logprobs
        for j in range(min(r.n, len(req.prompt) - 1 - r.start)):
            pos = r.start + 1 + j
            ids = host["prompt_top_ids"][r.row, j, :n_top]
            lps = host["prompt_top_logprobs"][r.row, j, :n_top]
            req.prompt_logprobs[pos] = sampling.TokenLogprob(
                req.prompt[pos], float(host["prompt_logprob"][r.row, j]),
                tuple((int(i), float(x)) for i, x in zip(ids, lps)))

    @staticmethod
    def _token_logprob(host: HostOutputs, row: int, col: int, token: int, n_top: int, on_device: bool,
                       sampled_on_device: bool) -> sampling.TokenLogprob:
        """The logprob of a committed token and the n_top most likely at its position: from the step's device
        outputs when the device chose the token (argmax or device sample: the full logits stay there), else from
        the logits the host sampled from."""
        if not (on_device or sampled_on_device):
            return sampling.token_logprob(host["logits"][row, col], token, n_top)
        lp = host["logits_sample_logprob" if sampled_on_device else "logits_argmax_logprob"][row, col]
        ids, lps = host["logits_top_ids"][row, col, :n_top], host["logits_top_logprobs"][row, col, :n_top]
        return sampling.TokenLogprob(token, float(lp), tuple((int(i), float(x)) for i, x in zip(ids, lps)))

    def _stop_reason(self, req: Request, t: int) -> str | None:
        p = req.params
        if t == self.runner.eos_token_id and not p.ignore_eos:
            return "stop"
        if t in p.stop_token_ids:
            return "stop"
        if req.stop_checker is not None and req.stop_checker(req.output):
            return "stop"
        if len(req.output) >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    # ---- failure
    def _fail_all(self, e: BaseException):
        self.dead = e
        for req in self.requests.values():
            if not req.finished:
                req.status, req.finish_reason = Status.FINISHED, "error"
                req.error = f"{type(e).__name__}: {e}"
        self.pending.clear()
        self.grammars.clear()

    def _alive(self):
        if self.dead is not None:
            raise EngineDeadError(f"engine failed earlier: {type(self.dead).__name__}: {self.dead}") from self.dead

    def usage(self) -> dict:
        return self.ledger.usage()
