"""The real model behind the engine's ModelRunner protocol (docs/engine-design.md, section 5).

`RealRunner(model, num_speculative_tokens)` wraps a loaded `api.Model`. Its pure `step` gathers each live row's
state through the `state_store` helpers (slot id -> committed column), runs `model.decoder_stack` (the same layer
loop as `model.forward`) with checkpoint columns (GDN recurrent/conv, PLE conv, the MTP hyper input after each of
the last K1 = k + 1 row tokens), writes the columns into the row's slot, and returns target logits and MTP draft
logits at the tail. `stage_step` is the same step over a range of layers with that range's store (a pipeline
stage, docs/pipeline.md); `step` is the one stage holding every layer. Where the GDN Pallas kernels run
(`gdn.uses_kernels`), the
recurrent state is the exception: it is never gathered, the kernels read and write the store leaf by slot id and
layer (`gdn.StoreRecState`), rows that are not live are passed as slot -1 and left untouched. The QSA layers read
and write their K/V/index pages in place through the page tables (`qsa_paged.PagedKV`: the step's entries first,
then only the indexer's chosen blocks and the tail); with `paged_qsa=False` (the oracle) the step instead builds
the dense per-row K/V layout of `model.forward` (length = the page-table width) and scatters the new entries back.

MTP bookkeeping (one position behind the main model): the MTP cache entry of pair (h_{q-1}, e_q) is computed at
RoPE position q-1 (exactly as `Model.mtp_logits`) but stored at page position q, so every write stays inside the
row's own range [start, start + n); the dense MTP cache is the paged one shifted by one position. The MTP layer
reads its pages in place as the main QSA layers do (mtp_paged.py: the fold writes the step's entries and block keys,
the drafts keep their own entries in a small side buffer); with paged_mtp=False (the oracle) it runs on a dense
per-row copy of the whole width, repeated for each tail column.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .gdn import CHUNK as GDN_CHUNK, StoreRecState, uses_kernels
from .mrope import SpanRope
from .request_images import EncoderCache, encode_images
from .model import decoder_stack, embed_hyper, final_logits, layer_counts
from . import mtp_paged
from .mtp import mtp_forward
from .ple import device_gather_rows, device_ngram_ids, gather_rows
from . import qsa_offload
from .qsa_paged import SCORE_TILE_ELEMENTS, PagedKV
from .state_store import Leaf, StoreSpec, live_rows, read_pages, read_slots, write_pages, write_slots

_PAGES = {"kv_k": "qsa_k", "kv_v": "qsa_v", "kv_index": "qsa_index"}  # State field -> store page leaf
_MTP_PAGES = ("mtp_k", "mtp_v", "mtp_index", "mtp_block_keys")  # the MTP layer's, in PagedKV's order


def table_to_device(table, memory_fraction: float = 0.9, slice_bytes: int = 1 << 30) -> jax.Array:
    """A host table (an np.memmap of the checkpoint's n-gram rows) on the default device, read and copied a slice
    at a time into one donated device buffer: the host never holds the whole table, the device never two copies."""
    from tqdm import tqdm

    from .page_pool import device_memory

    nbytes = table.nbytes  # (np.memmap, or convert.ngram.ShardedRows: the checkpoint's parts)
    memory = device_memory()
    if memory is not None and memory[1] + nbytes > memory_fraction * memory[0]:
        limit, used = memory
        raise ValueError(f"async scheduling needs the n-gram table on the device ({nbytes / 1e9:.1f} GB) but only "
                         f"{(memory_fraction * limit - used) / 1e9:.1f} GB of the device's {limit / 1e9:.1f} GB are "
                         f"free beside the weights: run without --async-scheduling")
    rows = max(1, slice_bytes // max(1, table.shape[1] * table.dtype.itemsize))
    put = jax.jit(lambda out, part, at: jax.lax.dynamic_update_slice(out, part, (at, 0)), donate_argnums=0)
    out = jnp.zeros(table.shape, table.dtype)
    for start in tqdm(range(0, table.shape[0], rows), desc="n-gram table to the device", unit=" slices",
                      disable=table.shape[0] <= rows):
        out = put(out, np.asarray(table[start: start + rows]), start)
    return out


def _take_tokens(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [B, T, ...], idx [B, J] -> a[b, idx[b, j]] [B, J, ...]."""
    return jnp.take_along_axis(a, idx.reshape(*idx.shape, *([1] * (a.ndim - 2))), axis=1)


class RealRunner:
    """ModelRunner for Qwen3.8-Flash-Next (`api.Model`). k = MTP draft tokens per step (0 = no MTP work at all)."""

    def __init__(self, model, num_speculative_tokens: int = 0, max_model_len: int | None = None,
                 paged_qsa: bool = True, qsa_score_elements: int = SCORE_TILE_ELEMENTS, max_images_per_prompt: int = 8,
                 paged_mtp: bool = True, encoder_cache_bytes: int = 512 << 20):
        cfg = model.cfg
        if num_speculative_tokens and not model.has_mtp:
            raise ValueError("speculative decoding needs MTP tensors; this checkpoint has none")
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.model, self.cfg = model, cfg
        self.k = int(num_speculative_tokens)
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = int(cfg.eos_token_id)
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        self.dtype = model.dtype
        self.params = model.params  # the n-gram table stays on the host (host_prepare gathers rows)
        self.hasher = model.hasher
        self.n_gdn, self.n_qsa, self.n_ple = len(cfg.gdn_layers), len(cfg.qsa_layers), len(cfg.ple_layers)
        self.num_layers = cfg.num_hidden_layers
        self.all_layers = range(cfg.num_hidden_layers)
        self._ple_row = None  # one gathered n-gram row: the width and dtype of host_prepare's output
        # QSA layers read the pages in place (qsa_paged.py) unless paged_qsa=False (the dense per-row oracle)
        self.paged_qsa = bool(paged_qsa and cfg.qsa_enabled and self.n_qsa)
        self.qsa_score_elements = int(qsa_score_elements)
        # the MTP head's QSA layer from its pages too (mtp_paged.py) unless paged_mtp=False (its dense oracle)
        self.paged_mtp = self.paged_qsa and bool(paged_mtp)
        # the engine may pad every step's page table to max_model_len's pages (one compiled width) when little
        # here costs more with a wider table: a paged prefill chunk loops over the row's own blocks only, a decode
        # step (the MTP drafts' too) scores the whole width's cached block keys in one pass (H200, 12 layers at
        # 262K: 1.2 ms, less than a loop over a 4K row's blocks, bench/results/select_decode.json), while the dense
        # oracles copy a per-row view of the whole width
        self.one_page_width = self.paged_qsa and (self.paged_mtp or self.k == 0)
        # GDN computes whole 64-token chunks of a prompt in one piece only inside one step (gdn.delta_rule_absolute):
        # a batch-invariant engine cuts prompts on this grid (SchedulerConfig.prefill_align)
        self.prefill_align = GDN_CHUNK if self.n_gdn else 1
        # image prompts (a checkpoint with a vision tower): each slot holds its request's image spans
        self.max_images = int(max_images_per_prompt) if getattr(model, "vision", None) is not None else 0
        # the tower's rows of recent images by content (request_images.EncoderCache): a chat's images run once
        self.encoder_cache = EncoderCache(encoder_cache_bytes if self.max_images else 0)
        self.qsa_kv_offload = False  # the QSA K/V pages in pinned host memory (with_qsa_kv_offload)

    def with_qsa_kv_offload(self) -> "RealRunner":
        """This runner with the QSA layers' K/V pages in pinned host memory (qsa_offload.py): only the blocks a
        step attends come to the device. Needs the paged QSA path and a backend with pinned host memory."""
        if not self.paged_qsa:
            raise ValueError("--qsa-kv-offload needs the paged QSA path (a model with QSA layers and an indexer, "
                             "RealRunner(paged_qsa=True))")
        device = jax.devices()[0]
        if not qsa_offload.supported(device):
            raise ValueError(f"--qsa-kv-offload needs pinned host memory; the {device.platform} backend offers "
                             f"{[m.kind for m in device.addressable_memories()]}")
        out = copy.copy(self)
        out.qsa_kv_offload = True
        return out

    # ---- protocol: what a request needs
    def store_spec(self, layers: range | None = None) -> StoreSpec:
        """The state of decoder layers `layers` (a pipeline stage; default: all of them). The MTP leaves belong to
        the stage holding the last layer (it runs the MTP head)."""
        c, dt = self.cfg, self.dtype
        layers = self.all_layers if layers is None else layers
        n = layer_counts(c, layers)
        kv, hd, di = c.num_key_value_heads, c.head_dim, c.indexer_head_dim or 1
        sh = c.hc_count * c.hidden_size
        slot = {
            "gdn_rec": Leaf((n["gdn"], c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                            jnp.float32, 0),
            "gdn_conv": Leaf((n["gdn"], c.linear_conv_kernel_dim - 1, c.gdn_conv_dim), dt, 0),
        }
        kv_memory = qsa_offload.HOST_MEMORY_KIND if self.qsa_kv_offload else "device"
        page = {"qsa_k": Leaf((n["qsa"], kv, hd), dt, memory_kind=kv_memory),
                "qsa_v": Leaf((n["qsa"], kv, hd), dt, memory_kind=kv_memory), "qsa_index": Leaf((n["qsa"], di), dt)}
        if self.paged_qsa:  # the indexer's compressed key of each complete block, written once (qsa_paged.py)
            page["qsa_block_keys"] = Leaf((n["qsa"], di), dt, tokens_per_row=c.indexer_compress_ratio)
        if n["ple"]:
            slot["ple_conv"] = Leaf((n["ple"], c.ple_conv_state_len, sh), dt, 0)
        if self.max_images:  # written by the ledger at allocation (image_slot_values), never by a step
            slot["mrope_spans"] = Leaf((self.max_images, 4), jnp.int32, 0)
        if self.k and layers.stop == c.num_hidden_layers:
            slot["mtp_h"] = Leaf((sh,), dt, 0)
            # one QSA layer's pages (the layer axis of the qsa_* leaves, of size 1)
            page.update(mtp_k=Leaf((1, kv, hd), dt), mtp_v=Leaf((1, kv, hd), dt), mtp_index=Leaf((1, di), dt))
            if self.paged_mtp:
                page["mtp_block_keys"] = Leaf((1, di), dt, tokens_per_row=c.indexer_compress_ratio)
        return StoreSpec(slot=slot, page=page)

    # ---- pipeline stages (pipeline.py)
    def stage_params(self, layers: range) -> dict:
        """The params a stage over `layers` reads: its layers; stage 0 the embeddings (and the final mixer norm,
        whose dtype a quantized embedding is cast to); the last stage the rest (final mixer, lm_head, MTP, which
        embeds its draft tokens)."""
        p = self.params
        out = {"layers": p["layers"].select(layers)}
        if layers.start == 0:
            out |= {"embed_tokens": p["embed_tokens"], "hyper_connection_mixer": p["hyper_connection_mixer"]}
        if layers.stop == self.num_layers:
            out |= {n: v for n, v in p.items() if n != "layers"}
        return out

    def stage_host_inputs(self, layers: range) -> tuple[str, ...]:
        """host_prepare outputs a stage reads: the n-gram rows go to the stage holding the PLE layer(s)."""
        return ("ple_rows",) if any(x in layers for x in self.cfg.ple_layers) else ()

    # ---- image prompts (request_images.py)
    def encode_images(self, prompt, images):
        """The vision tower over a request's images (its own jitted program, bucketed patch counts), before the
        request's prefill -> request_images.RequestImages."""
        if not self.max_images:
            raise ValueError("this checkpoint has no vision tower (model.visual.* and vision_config)")
        return encode_images(self.model.vision, prompt, images, self.dtype, self.max_images, self.encoder_cache)

    def image_slot_values(self, images) -> dict[str, np.ndarray]:
        """What the ledger writes into an image request's slot when it is allocated: its spans (mrope.SpanRope)."""
        return {"mrope_spans": images.spans}

    def image_inputs(self, rows, T: int) -> dict[str, np.ndarray]:
        """An image step's host inputs: which rows have images (the others' slots are not read for spans), and the
        tower's rows for the pads each row's tokens cover, [B, T, H] in the model's dtype, with their mask."""
        embeds = np.zeros((len(rows), T, self.cfg.hidden_size), self.dtype)
        mask = np.zeros((len(rows), T), bool)
        image_rows = np.zeros(len(rows), bool)
        for b, row in enumerate(rows):
            if row is not None and row.images is not None:
                image_rows[b] = True
                at, values = row.images.rows_for(row.start, len(row.tokens))
                embeds[b, at], mask[b, at] = values, True
        return {"image_rows": image_rows, "image_embeds": embeds, "image_mask": mask}

    # ---- protocol: host side (PLE n-gram rows; the table never enters the jitted params)
    def host_prepare(self, rows, T: int) -> dict[str, np.ndarray]:
        images = self.image_inputs(rows, T) if any(r is not None and r.images is not None for r in rows) else {}
        return self._ngram_rows(rows, T) | images

    def _ngram_rows(self, rows, T: int) -> dict[str, np.ndarray]:
        if not self.n_ple:
            return {}
        h = self.hasher
        out = None
        for b, row in enumerate(rows):
            if row is None or not len(row.tokens):
                continue
            hist = np.asarray(row.history[-h.context_len:], np.int64)
            ctx = np.concatenate([h.initial_context()[: h.context_len - len(hist)], hist])
            g = gather_rows(self.model.table, h.ids(ctx, np.asarray(row.tokens, np.int64)), self.model.table_scale)
            if out is None:
                out = np.zeros((len(rows), T, g.shape[-1]), g.dtype)
            out[b, : len(row.tokens)] = g
        if out is None:  # no row has tokens (padding; precompile's abstract batch): a real row's width and dtype
            if self._ple_row is None:
                self._ple_row = gather_rows(self.model.table, np.zeros((1, self.cfg.ngram_heads), np.int64),
                                            self.model.table_scale)[0]
            out = np.zeros((len(rows), T, self._ple_row.shape[-1]), self._ple_row.dtype)
        return {"ple_rows": out}

    # ---- protocol (optional): a chained step's host inputs on the device (async scheduling, engine.py)
    @property
    def chain_context_len(self) -> int:
        """Tokens before a chained token that its host inputs read (the n-gram context)."""
        return self.hasher.context_len if self.n_ple else 0

    def place_chain_inputs(self, memory_fraction: float = 0.9) -> dict:
        """What `chained_host_inputs` reads on the device: the n-gram table (the release's is ~51 GB, beside ~67 GB of
        INT4-Mixed weights on one H200), copied in slices with a progress bar; a clear error when it cannot fit in
        `memory_fraction` of the device's memory beside what is already there."""
        if not self.n_ple:
            return {}
        return {"ngram_table": table_to_device(self.model.table, memory_fraction)}

    def chained_host_inputs(self, chain_params: dict, tokens, positions, context) -> dict:
        """host_prepare's outputs for one token per row [B], made on the device (the token is known only there, at
        `positions` [B]; context [B, chain_context_len]: the tokens before it, -1 before the request's first):
        name -> [B, ...], column 0 of the chained rows (step_programs.chain_tokens). Traced with 64-bit integers
        (ple.device_ngram_ids)."""
        if not self.n_ple:
            return {}
        h = self.hasher
        context = jnp.where(context < 0, h.eos, context)
        return {"ple_rows": device_gather_rows(chain_params["ngram_table"], device_ngram_ids(h, context, tokens),
                                               self.model.table_scale)}

    # ---- protocol: logits of any position (prompt logprobs)
    def logits(self, params, hidden):
        """The step's "hidden" output [..., S*H] (the pre-final-mixer hyper state) -> fp32 logits [..., V]."""
        return final_logits(params, self.cfg, hidden.astype(self.dtype))

    # ---- protocol: the pure step (one stage holding every layer)
    def step(self, params, store, batch, all_positions: bool = False):
        return self.stage_step(params, store, batch, None, self.all_layers, all_positions)

    def stage_step(self, params, store, batch, x, layers: range, all_positions: bool = False):
        """Pipeline stage over decoder layers `layers` with its own store (`store_spec(layers)`).

        The first stage (layers.start == 0) embeds the tokens, every other one takes the previous stage's hyper
        state `x` [B, T, S*H]; the last stage (layers.stop == num_layers) ends with the final mixer, lm_head and
        MTP and returns (store, outputs), every other one returns (store, x) for the next stage. all_positions
        (last stage): the outputs also hold every position's hyper state ("hidden", for prompt logprobs)."""
        cfg, dt = self.cfg, self.dtype
        first, last = layers.start == 0, layers.stop == cfg.num_hidden_layers
        B, T = batch.tokens.shape
        K1 = next(iter(store.slot.values())).shape[1]
        live = live_rows(store, batch.slot, batch.gen)
        # On the kernel path the GDN recurrent state is never gathered: the kernels read each row's committed
        # column and write its checkpoint columns in the store leaf itself, by slot id (stale rows: slot -1).
        in_place = store.slot["gdn_rec"].shape[2] > 0 and uses_kernels(dt)
        # written by the ledger only (image_slot_values); read only in steps with images (text steps as before)
        by_ledger = ("mrope_spans",) if "mrope_spans" in store.slot else ()
        images = "image_rows" in batch.host
        st = read_slots(store, batch.slot, live, skip=(("gdn_rec",) if in_place else ()) + (() if images else by_ledger))
        mrope = None
        if images:  # text rows' slots may hold a restored snapshot's spans: they count as no image
            spans = jnp.where(batch.host["image_rows"][:, None, None], st.pop("mrope_spans"), 0)
            mrope = SpanRope(spans, self.model.vision.mrope_section)
        n_valid, start, tokens = batch.n_valid, batch.start, batch.tokens
        base = jnp.maximum(n_valid - K1, 0)
        ends = base[:, None] + 1 + jnp.arange(K1)[None, :]  # tokens folded after column c
        tail = jnp.minimum(ends - 1, T - 1)  # [B, K1] row offsets of the tail tokens
        positions = start[:, None] + jnp.arange(T)[None, :]
        valid = jnp.arange(T)[None, :] < n_valid[:, None]
        wvalid = valid & live[:, None]

        ratio = cfg.indexer_compress_ratio or 1

        def dense(name):  # paged per-token entries -> [n_qsa, B, L, ...] (L a multiple of the QSA block ratio)
            a = read_pages(store, name, batch.page_table)
            pad = (-a.shape[1]) % ratio
            a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) if pad else a
            return jnp.moveaxis(a, 2, 0)

        # every state leaf as [layer-of-kind (stage-local), B, ...], under the State field names decoder_layer reads
        stack_state = {name: jnp.moveaxis(st[name], 1, 0) for name in ("gdn_conv", "gdn_rec", "ple_conv")
                       if name in st}
        if in_place:
            stack_state["gdn_rec"] = StoreRecState(store.slot["gdn_rec"], jnp.where(live, batch.slot, -1),
                                                   store.cursor[jnp.clip(batch.slot, 0, store.num_slots)], 0)
        L = -(-batch.page_table.shape[1] * store.page["qsa_k"].shape[1] // ratio) * ratio  # the dense KV length
        qpos = jnp.minimum(positions, L - 1)
        has_qsa = store.page["qsa_k"].shape[2] > 0  # a pipeline stage may hold no QSA layer
        if self.qsa_kv_offload and store.page["qsa_k"].shape[1] % ratio:
            raise ValueError(f"--qsa-kv-offload needs a page size that is a multiple of the QSA block ratio "
                             f"({ratio}), got {store.page['qsa_k'].shape[1]}")
        if has_qsa and self.paged_qsa and store.page["qsa_k"].shape[1] % ratio == 0:  # blocks within pages
            stack_state["qsa_pages"] = PagedKV(store.page["qsa_k"], store.page["qsa_v"], store.page["qsa_index"],
                                               store.page["qsa_block_keys"], batch.page_table, wvalid, 0,
                                               self.qsa_score_elements, self.qsa_kv_offload)
        elif has_qsa:
            stack_state |= {name: dense(page) for name, page in _PAGES.items()}

        # ---- decoder layers: GDN/PLE states come back per checkpoint column, K/V caches whole (keep the new tokens)
        if first:
            x = embed_hyper(params, cfg, tokens, batch.host.get("image_embeds"), batch.host.get("image_mask"))
        ple_rows = None  # the host-gathered n-gram rows, the same for every PLE layer of the stage
        if "ple_conv" in st:
            rows = batch.host["ple_rows"].astype(dt)
            ple_rows = jnp.broadcast_to(rows[None], (st["ple_conv"].shape[1], *rows.shape))
        x, new = decoder_stack(params["layers"], cfg, layers, x, ple_rows, positions, valid, n_valid, stack_state,
                               ends, keep=lambda name, a: _take_tokens(a, qpos) if name in _PAGES else a, mrope=mrope)
        rec = new.pop("gdn_rec") if in_place else None
        pages = new.pop("qsa_pages", None)
        new = {name: jnp.moveaxis(a, 0, 2) for name, a in new.items()}  # [B, K1 or T, layer-of-kind, ...]
        if pages is not None:  # the paged path wrote this step's entries in place, layer by layer
            store = dataclasses.replace(store, page={**store.page, "qsa_k": pages.k, "qsa_v": pages.v,
                                                     "qsa_index": pages.index, "qsa_block_keys": pages.block_keys})
        for name, page in _PAGES.items():
            if name in new:
                store = write_pages(store, page, batch.page_table, positions, wvalid, new[name])
        cols = {name: a for name, a in new.items() if name not in _PAGES}
        for name, leaf in store.slot.items():  # a stage without layers of a kind: its empty leaves
            if name not in cols and leaf.shape[2] == 0 and not (in_place and name == "gdn_rec"):
                cols[name] = jnp.zeros((B, K1, *leaf.shape[2:]), leaf.dtype)

        if last:
            hyper = x  # [B, T, S*H] pre-final-mixer
            h_tail = _take_tokens(hyper, tail)  # [B, K1, S*H]
            logits = final_logits(params, cfg, h_tail)  # [B, K1, V]
            if self.k:
                cols["mtp_h"] = h_tail
                store, dlogits = self._mtp(params, store, batch, st["mtp_h"], hyper, h_tail, logits, tail, live, L,
                                           mrope)
            else:
                dlogits = jnp.zeros((B, K1, 0, cfg.vocab_size), jnp.float32)
        if in_place:
            store = dataclasses.replace(store, slot={**store.slot, "gdn_rec": rec})
        store = write_slots(store, batch.slot, live, cols,
                            written_in_place=(("gdn_rec",) if in_place else ()) + by_ledger)
        if not last:
            return store, x
        out = {"logits": logits, "draft_logits": dlogits}
        if all_positions:  # every position's hyper state, for logits at every prompt position (self.logits)
            out["hidden"] = hyper
        return store, out

    def _mtp(self, params, store, batch, mtp_h, hyper, h_tail, logits, tail, live, L, mrope=None):
        """MTP: fold this step's pairs (h_{q-1}, e_q) into the MTP cache (page position q, RoPE position q - 1) and
        draft k tokens after each tail column without writing the cache. In an image step (`mrope`: the rows'
        spans) the RoPE positions are those indices' 3-D positions, as the main model's, and a pad token q enters
        its pair as the tower's row (mtp.py); drafts are generated tokens, never an image's. Paged (mtp_paged.py)
        or, with paged_mtp=False, the dense oracle (`_mtp_dense`)."""
        cfg = self.cfg
        T = batch.tokens.shape[1]
        start, n_valid, tokens = batch.start, batch.n_valid, batch.tokens
        off = (start == 0).astype(jnp.int32)  # position 0 has no predecessor: its pair does not exist
        j = jnp.arange(T)[None, :]
        q = start[:, None] + off[:, None] + j  # input token position of pair j
        n_pairs = jnp.maximum(n_valid - off, 0)
        wvalid = (j < n_pairs[:, None]) & live[:, None]
        prev = jnp.concatenate([mtp_h[:, None], hyper], axis=1)  # prev[:, i] = h at position start - 1 + i
        h_prev = _take_tokens(prev, jnp.minimum(q - start[:, None], T))
        at = jnp.minimum(q - start[:, None], T - 1)  # row offset of each pair's token q
        e_tok = _take_tokens(tokens, at)
        image = {}
        if mrope is not None:
            image = dict(image_embeds=_take_tokens(batch.host["image_embeds"], at),
                         image_mask=_take_tokens(batch.host["image_mask"], at))
        tail_index = start[:, None] + tail  # [B, K1] cache index of each column's tail token
        if not self.paged_mtp:
            return self._mtp_dense(params, store, batch.page_table, h_prev, e_tok, q, n_pairs, wvalid, h_tail,
                                   logits, tail_index, L, mrope, image)
        kv = PagedKV(*(store.page[name] for name in _MTP_PAGES), batch.page_table, wvalid, 0,
                     self.qsa_score_elements)
        kv = mtp_paged.fold(params, cfg, kv, h_prev, e_tok, q, mrope, **image)
        store = dataclasses.replace(store, page={**store.page, **dict(zip(_MTP_PAGES, kv[:4]))})
        return store, mtp_paged.drafts(params, cfg, kv, h_tail, logits, tail_index, self.k, mrope)

    def _mtp_dense(self, params, store, page_table, h_prev, e_tok, q, n_pairs, wvalid, h_tail, logits, tail_index,
                   L, mrope, image):
        """The oracle: the MTP layer (`mtp.mtp_forward`) on a dense per-row copy of the pages, dense[i] =
        paged[i + 1], of the whole page-table width L."""
        cfg, k = self.cfg, self.k
        B, K1 = tail_index.shape
        ratio = cfg.indexer_compress_ratio or 1
        length = -(-(L + k) // ratio) * ratio  # room for the chained draft keys past the last page position

        def dense(name):  # dense[i] = paged[i + 1] (the leaves' one layer dropped)
            a = read_pages(store, name, page_table)[:, 1:, 0]
            pad = length - a.shape[1]
            return jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))

        cache = tuple(dense(n) for n in _MTP_PAGES[:3])
        _, _, cache = mtp_forward(params, cfg, h_prev, e_tok, q[:, 0] - 1, n_pairs, cache, mrope, **image)
        rpos = jnp.clip(q - 1, 0, cache[0].shape[1] - 1)
        for name, a in zip(_MTP_PAGES, cache):
            store = write_pages(store, name, page_table, q, wvalid, _take_tokens(a, rpos)[:, :, None])

        # drafts: column c = MTP(h at tail token, e(argmax)) at the tail token's position, chained k times. The K1
        # columns are alternative futures (one per accepted count), so each needs the cache without the others'
        # draft keys: they run as K1 * B rows of one call, each on its own copy of its row's cache (one MTP layer
        # call per draft instead of K1: on the CPU each call's ~100 small ops cost more than its arithmetic)
        rows = lambda a: jnp.repeat(a, K1, axis=0)  # noqa: E731  [B, ...] -> [B * K1, ...], row b * K1 + c
        h = h_tail.reshape(B * K1, 1, h_tail.shape[-1])
        pos = tail_index.reshape(B * K1)
        y = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(B * K1)
        cc = tuple(rows(a) for a in cache)
        spans = None if mrope is None else dataclasses.replace(mrope, spans=rows(mrope.spans))
        one = jnp.ones((B * K1,), jnp.int32)
        col = []
        for i in range(k):
            dl, h, cc = mtp_forward(params, cfg, h, y[:, None], pos + i, one, cc, spans)
            col.append(dl[:, 0])
            y = jnp.argmax(dl[:, 0], axis=-1).astype(jnp.int32)
        return store, jnp.stack(col, 1).reshape(B, K1, k, -1)  # [B, K1, k, V]


__all__ = ["RealRunner"]
