"""Public single-request API: `load(path)` -> `Model` with `logits()` and greedy `generate()`.

The batched, slot-indexed serving engine lives in `engine.py`/`llm.py`; this module is the smallest correct way to
run the model, used by notebooks, parity tests and the `flashnext generate` CLI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pallas_kernels import fixed_order

from .config import ModelConfig, from_hf_config
from .layer_stack import build_stacked_on_host, with_stacked_layers
from .model import Batch, State, forward, init_state
from .mrope import MRope, position_table, prompt_positions, section_of
from .mtp import init_mtp_cache, mtp_forward
from .ple import NgramHasher, gather_rows
from .weights import PLE_BUFFERS, CheckpointError, build_params, check_tensors

log = logging.getLogger("flashnext_jax")

DEMO_MODEL = Path(__file__).parent / "demo_model"
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "bf16": jnp.bfloat16, "fp32": jnp.float32}


def _bucket(n: int, minimum: int = 16) -> int:
    """Round lengths up to powers of two so jit compiles once per bucket, not once per length."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


# the solo reference runs in the engine's default numerics: batch invariant (pallas_kernels/fixed_order.py)
@partial(jax.jit, static_argnames=("cfg", "logits_last_only"), donate_argnames=("state",),
         compiler_options=fixed_order.compiler_options(True))
def _jit_step(params, cfg: ModelConfig, batch: Batch, state: State, logits_last_only: bool):
    return forward(params, cfg, batch, state, logits_last_only=logits_last_only)


_compiled: set = set()


def _step(params, cfg: ModelConfig, batch: Batch, state: State, logits_last_only: bool):
    """The jitted step (state donated); logs when a new shape bucket is about to be compiled."""
    key = (cfg, batch.tokens.shape, state.kv_k.shape[2], logits_last_only, str(state.gdn_conv.dtype))
    if key not in _compiled:
        _compiled.add(key)
        log.info("compiling step for batch %s, cache length %d (once per bucket)", batch.tokens.shape,
                 state.kv_k.shape[2])
    return _jit_step(params, cfg, batch, state, logits_last_only)


@partial(jax.jit, static_argnames=("cfg",), compiler_options=fixed_order.compiler_options(True))
def _mtp_step(params, cfg, hyper, next_tokens, start, n_valid, cache, mrope=None, image_embeds=None, image_mask=None):
    return mtp_forward(params, cfg, hyper, next_tokens, start, n_valid, cache, mrope, image_embeds, image_mask)


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """Preprocessed images of one prompt (vision_preprocess.preprocess_images), in the order of their pad runs."""

    pixel_values: np.ndarray  # [patches, 3 * temporal_patch_size * patch^2] float32
    grid_thw: np.ndarray  # [n_images, 3] int


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """What image input needs besides the text model: the tower, the image token and the MRoPE layout."""

    cfg: object  # vision.VisionConfig
    params: dict
    image_token_id: int
    mrope_section: tuple[int, int, int]
    processor: object | None  # vision_preprocess.ImageProcessorConfig (None without preprocessor_config.json)


class Model:
    """A loaded model: config, params (device), the n-gram table (host) and its hasher; the vision tower when the
    checkpoint has one (`vision`)."""

    def __init__(self, cfg: ModelConfig, params: dict, table, dtype, path: Path | None = None,
                 table_scale: float | None = None, vision: VisionTower | None = None):
        # decoder layers stacked over layers: ~80 arrays instead of ~1660, each costing host time per call
        params = with_stacked_layers(params)
        self.cfg, self.params, self.table, self.dtype, self.path = cfg, params, table, dtype, path
        self.table_scale = table_scale  # FP8 n-gram tables carry one per-tensor scale
        self.hasher = NgramHasher(cfg) if cfg.ple_layers else None
        self.has_mtp = "mtp" in params
        self.vision = vision

    # ---- host side --------------------------------------------------------------------------------
    def check_tokens(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence of integers")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("token_ids must be integers")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is out of range [0, {self.cfg.vocab_size})")
        return ids.astype(np.int64)

    def ple_rows(self, context: np.ndarray | None, tokens: np.ndarray, length: int) -> np.ndarray:
        """Host-gathered n-gram rows [n_ple, 1, length, E] for `tokens` (zero-padded to `length`)."""
        if self.hasher is None:
            return np.zeros((0, 1, length, 1), np.float32)
        ctx = self.hasher.initial_context() if context is None else context
        rows = gather_rows(self.table, self.hasher.ids(ctx, tokens), self.table_scale)
        out = np.zeros((1, 1, length, rows.shape[-1]), rows.dtype)
        out[0, 0, : len(tokens)] = rows
        return out

    def _batch(self, tokens: np.ndarray, start: int, length: int, context) -> Batch:
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(tokens)] = tokens
        return Batch(tokens=jnp.asarray(padded), start=jnp.asarray([start], jnp.int32),
                     n_valid=jnp.asarray([len(tokens)], jnp.int32),
                     ple_rows=jnp.asarray(self.ple_rows(context, tokens, length), self.dtype))

    # ---- image input ------------------------------------------------------------------------------
    def image_prompt(self, token_ids: Sequence[int], images: Sequence,
                     processor=None) -> tuple[list[int], ImageInput]:
        """A templated prompt with one <|image_pad|> per image + PIL images -> (ids with the pads expanded, the
        preprocessed images), as transformers' processor does. processor: a vision_preprocess.ImageProcessorConfig
        instead of the checkpoint's (LLM's mm_processor_kwargs)."""
        from .vision_preprocess import expand_image_tokens, preprocess_images

        tower = self._tower()
        processor = processor or tower.processor
        if processor is None:
            raise ValueError("this checkpoint has no preprocessor_config.json")
        pixel_values, grid = preprocess_images(list(images), processor)
        ids = expand_image_tokens(list(token_ids), grid, tower.image_token_id, processor.merge_size)
        return ids, ImageInput(pixel_values, grid)

    def image_embeddings(self, images: ImageInput) -> jax.Array:
        """The vision tower's output [image tokens, hidden] (one row per pad token, images in order)."""
        from .vision import image_embeddings

        tower = self._tower()
        return image_embeddings(tower.params, tower.cfg, images.pixel_values, images.grid_thw)

    def _tower(self) -> VisionTower:
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (model.visual.* and vision_config)")
        return self.vision

    def _image_fields(self, ids: np.ndarray, images: ImageInput, length: int, cache_len: int) -> dict:
        """Batch fields of an image prompt: pads replaced by the tower's rows, 3-D positions (the rope_delta of the
        tokens after the prompt is in the position table)."""
        tower = self._tower()
        mask = ids == tower.image_token_id
        rows = self.image_embeddings(images)
        if int(mask.sum()) != rows.shape[0]:
            raise ValueError(f"the prompt has {int(mask.sum())} image pad tokens, the images give {rows.shape[0]}")
        positions, delta = prompt_positions(ids, images.grid_thw, tower.image_token_id, tower.cfg.spatial_merge_size)
        padded_mask = np.zeros((1, length), bool)
        padded_mask[0, : len(ids)] = mask
        embeds = jnp.zeros((1, length, rows.shape[1]), self.dtype).at[0, np.nonzero(mask)[0]].set(
            rows.astype(self.dtype))
        mrope = MRope(jnp.asarray(position_table(positions, delta, cache_len)[None]), tower.mrope_section)
        return dict(image_embeds=embeds, image_mask=jnp.asarray(padded_mask), mrope=mrope)

    # ---- public API -------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int], images: ImageInput | None = None) -> np.ndarray:
        """Prefill one unpadded sequence -> fp32 logits [T, vocab]. With `images`, token_ids hold their expanded
        pad tokens (`image_prompt`)."""
        ids = self.check_tokens(token_ids)
        t = len(ids)
        length = _bucket(t)
        state = init_state(self.cfg, 1, length, self.dtype)
        batch = self._batch(ids, 0, length, None)
        if images is not None:
            batch = batch.replace(**self._image_fields(ids, images, length, state.kv_k.shape[2]))
        logits, _, _ = _step(self.params, self.cfg, batch, state, False)
        return np.asarray(logits[0, :t], np.float32)

    def hidden_and_logits(self, token_ids: Sequence[int], images: ImageInput | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """-> (pre-final-mixer hyper state [T, S*H], logits [T, V]) for one sequence (used by MTP tests); `images`
        as in `logits`."""
        ids = self.check_tokens(token_ids)
        length = _bucket(len(ids))
        state = init_state(self.cfg, 1, length, self.dtype)
        batch = self._batch(ids, 0, length, None)
        if images is not None:
            batch = batch.replace(**self._image_fields(ids, images, length, state.kv_k.shape[2]))
        logits, hyper, _ = _step(self.params, self.cfg, batch, state, False)
        return np.asarray(hyper[0, : len(ids)]), np.asarray(logits[0, : len(ids)], np.float32)

    def mtp_logits(self, token_ids: Sequence[int], images: ImageInput | None = None) -> np.ndarray:
        """MTP draft logits [T-1, V]: row p predicts token p+2 from hidden p and token p+1 (teacher-forced). With
        `images` (as in `logits`; tokens after the prompt are text) row p sits at the main model's 3-D position of
        index p, and a pad token p+1 enters as the tower's row (mtp.py)."""
        if not self.has_mtp:
            raise ValueError("this checkpoint has no MTP tensors")
        ids = self.check_tokens(token_ids)
        t = len(ids)
        hyper, _ = self.hidden_and_logits(ids, images)
        length = _bucket(t)
        hyper_p = np.zeros((1, length, hyper.shape[-1]), hyper.dtype)
        hyper_p[0, : t - 1] = hyper[: t - 1]
        nxt = np.zeros((1, length), np.int32)
        nxt[0, : t - 1] = ids[1:]
        cache = init_mtp_cache(self.cfg, 1, length, self.dtype)
        image = {}
        if images is not None:  # the fields of ids, shifted one left: row p holds token p + 1's
            fields = self._image_fields(ids, images, length, cache[0].shape[1])

            def shifted(a):
                return jnp.concatenate([a[:, 1:], jnp.zeros_like(a[:, :1])], axis=1)
            image = dict(mrope=fields["mrope"], image_embeds=shifted(fields["image_embeds"]),
                         image_mask=shifted(fields["image_mask"]))
        logits, _, _ = _mtp_step(self.params, self.cfg, jnp.asarray(hyper_p), jnp.asarray(nxt),
                                 jnp.zeros((1,), jnp.int32), jnp.asarray([t - 1], jnp.int32), cache, **image)
        return np.asarray(logits[0, : t - 1], np.float32)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 32, *, stop_at_eos: bool = False,
                 images: ImageInput | None = None) -> list[int]:
        """Greedy decoding: prefill, then one incremental decode step per new token on this request's state. With
        `images` (token_ids expanded, see `logits`) the decode steps sit at their index + rope_delta."""
        ids = self.check_tokens(token_ids)
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if max_new_tokens == 0:
            return []
        total = len(ids) + max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_position_embeddings")
        state = init_state(self.cfg, 1, _bucket(total), self.dtype)
        length = _bucket(len(ids))
        batch, mrope = self._batch(ids, 0, length, None), None
        if images is not None:
            fields = self._image_fields(ids, images, length, state.kv_k.shape[2])
            batch, mrope = batch.replace(**fields), fields["mrope"]
        logits, _, state = _step(self.params, self.cfg, batch, state, True)
        context = self.hasher.next_context(self.hasher.initial_context(), ids) if self.hasher else None
        out: list[int] = []
        pos = len(ids)
        while True:
            token = int(jnp.argmax(logits[0, -1]))
            out.append(token)
            if len(out) == max_new_tokens or (stop_at_eos and token == self.cfg.eos_token_id):
                return out
            step_ids = np.array([token], np.int64)
            batch = self._batch(step_ids, pos, 1, context)
            if mrope is not None:
                batch = batch.replace(mrope=mrope)
            logits, _, state = _step(self.params, self.cfg, batch, state, True)
            if self.hasher:
                context = self.hasher.next_context(context, step_ids)
            pos += 1


def load(path: str | Path | None = None, *, dtype: str = "bfloat16", device: str | None = None) -> Model:
    """Load a checkpoint directory: HF bf16 (release or CausalLM layout), an HF quantized checkpoint
    (compressed-tensors, AutoRound, AWQ, block-FP8: converted in memory), or a directory written by
    `flashnext-convert`. None -> the embedded demo model. Quantized weights stay quantized. device: None puts the
    params on jax's default device; "host" keeps them as numpy arrays, for a pipeline that places each stage's
    share on the stage's own devices (pipeline.py) without the whole model passing through one device first."""
    if device not in (None, "host"):
        raise ValueError(f"device must be None or 'host', got {device!r}")
    from convert import ConvertError, read_checkpoint

    path = Path(path) if path is not None else DEMO_MODEL
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    jdtype = _DTYPES[dtype]
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    t0 = time.perf_counter()
    if (path / "config.json").exists():  # config errors name the field before any tensor is read
        from_hf_config(json.loads((path / "config.json").read_text()))
    try:
        hf, stream, table, table_scale = read_checkpoint(str(path))
        cfg = from_hf_config(hf)
        tensors = dict(tqdm(stream, desc=f"loading {path.name}", unit=" tensors", disable=None, leave=False))
    except ConvertError as e:
        raise CheckpointError(str(e)) from None
    buffers = {n: tensors.pop(n) for n in [n for n in tensors if n.endswith(PLE_BUFFERS)]}
    has_mtp = check_tensors(cfg, {n: torch_shape(v) for n, v in tensors.items()})
    if cfg.ple_layers:
        _check_table(cfg, table, buffers)
    n_tensors = len(tensors)
    params = build_stacked_on_host(lambda: build_params(cfg, _consume(tensors), jdtype, host=True), device)
    log.info("loaded %s (%d tensors%s) in %.1fs", path, n_tensors, ", MTP" if has_mtp else "",
             time.perf_counter() - t0)
    return Model(cfg, params, table, jdtype, path, table_scale, _load_vision(path, jdtype))


def _consume(tensors: dict):
    """tensors' items, each dropped from the dict as it is handed out: the host holds the checkpoint's copy of a
    tensor or the model's, not both (~2x the model's size otherwise)."""
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def _load_vision(path: Path, dtype) -> VisionTower | None:
    """The checkpoint's vision tower (unquantized, as the release keeps it; an HF directory or a converted one),
    or None if it has none."""
    from .vision import load_vision_params
    from .vision_preprocess import load_processor_config

    hf = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if "vision_config" not in hf or "image_token_id" not in hf:
        return None  # text-only
    loaded = load_vision_params(path, dtype)
    if loaded is None:
        return None
    processor = load_processor_config(path) if (path / "preprocessor_config.json").exists() else None
    log.info("vision tower: %d blocks, %d-wide", loaded[0].depth, loaded[0].hidden_size)
    return VisionTower(loaded[0], loaded[1], int(hf["image_token_id"]), section_of(hf["text_config"]), processor)


def torch_shape(value) -> tuple:
    """Shape in checkpoint (torch) orientation: quantized weights are stored transposed, [..., in, out]."""
    shape = tuple(value.shape)
    return shape if isinstance(value, np.ndarray) else shape[:-2] + (shape[-1], shape[-2])


def _check_table(cfg: ModelConfig, table, buffers: dict) -> None:
    hasher = NgramHasher(cfg)
    if table is None:
        raise CheckpointError("missing tensors: the PLE n-gram table (ple.ple_embedding.ngram_embedding.*)")
    if tuple(table.shape) != (hasher.padded_rows, cfg.ngram_row_width):
        raise CheckpointError(f"n-gram table is {list(table.shape)}, expected [{hasher.padded_rows}, "
                              f"{cfg.ngram_row_width}]")
    recomputed = {"layer_multipliers": hasher.multipliers, "ngram_heads_vocab_sizes": hasher.sizes,
                  "ngram_heads_offsets": hasher.offsets}
    for name, value in buffers.items():
        if not np.array_equal(np.asarray(value, np.int64), recomputed[name.rsplit(".", 1)[-1]]):
            raise CheckpointError(f"{name} in the checkpoint differs from the value recomputed from the config")
