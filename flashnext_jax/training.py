"""Training losses over the model's own pure-JAX forward, and `train_mtp` (fine-tune only the MTP head, optax).

The forward used here is `model.forward` / `mtp.mtp_forward` exactly as inference runs them (float32, the
reference paths: the GDN chunked delta rule, QSA with its block selection, top-k MoE), so what is trained is what
is served. Only the n-gram rows differ in where they are gathered: on the host at inference (`ple.gather_rows`),
inside the loss here (`table[ids]`) so that the table gets gradients too. See docs/demo-model.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from . import gdn, moe
from .config import ModelConfig
from .model import Batch, forward, init_state
from .mtp import init_mtp_cache, mtp_forward
from .ple import NgramHasher


@contextlib.contextmanager
def training_paths(gdn_chunk: int = 32):
    """While tracing a loss: GDN's chunked reference at `gdn_chunk`, experts as `moe.routed_experts_dense` (both
    the same math as inference, with backward passes that are fast on CPU; see their comments). Trace-time only:
    a jitted function keeps the paths it was traced with."""
    saved = gdn.TRAINING_CHUNK, moe.TRAINING_DENSE_EXPERTS
    gdn.TRAINING_CHUNK, moe.TRAINING_DENSE_EXPERTS = gdn_chunk, True
    try:
        yield
    finally:
        gdn.TRAINING_CHUNK, moe.TRAINING_DENSE_EXPERTS = saved


def ngram_ids(hasher: NgramHasher | None, tokens: np.ndarray) -> np.ndarray:
    """Host n-gram row ids [B, T, heads] for windows that each start a fresh request (EOS-filled context)."""
    if hasher is None:
        return np.zeros((*tokens.shape, 0), np.int32)
    return np.stack([hasher.ids(hasher.initial_context(), row) for row in tokens]).astype(np.int32)


def main_forward(params: dict, table, cfg: ModelConfig, tokens, ids):
    """Teacher-forced forward over windows tokens [B, T] -> (logits [B, T, V] fp32, hyper [B, T, S*H])."""
    bsz, t = tokens.shape
    n_ple = len(cfg.ple_layers)
    if n_ple > 1:
        raise NotImplementedError("training supports at most one PLE layer (the demo and release have one)")
    rows = table[ids].reshape(n_ple, bsz, t, -1) if n_ple else jnp.zeros((0, bsz, t, 1), jnp.float32)
    dtype = params["hyper_connection_mixer"]["hc_norm"].dtype
    batch = Batch(tokens=tokens, start=jnp.zeros((bsz,), jnp.int32), n_valid=jnp.full((bsz,), t, jnp.int32),
                  ple_rows=rows.astype(dtype))
    logits, hyper, _ = forward(params, cfg, batch, init_state(cfg, bsz, t, dtype))
    return logits, hyper


def mtp_logits(params: dict, cfg: ModelConfig, hyper, tokens):
    """Teacher-forced MTP drafts: row p (0..T-3) reads hyper p and token p+1 and predicts token p+2."""
    bsz, t = tokens.shape
    cache = init_mtp_cache(cfg, bsz, t - 2, hyper.dtype)
    logits, _, _ = mtp_forward(params, cfg, hyper[:, : t - 2], tokens[:, 1 : t - 1], jnp.zeros((bsz,), jnp.int32),
                               jnp.full((bsz,), t - 2, jnp.int32), cache)
    return logits


_jit_mtp_logits = jax.jit(mtp_logits, static_argnums=(1,))


def cross_entropy(logits, targets) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def lm_losses(params: dict, table, cfg: ModelConfig, tokens, ids, *, with_mtp: bool = True):
    """-> (next-token loss, next-next-token loss of the MTP head, or 0). The MTP head reads the hyper state through
    stop_gradient: its loss trains the head (and the shared embedding / lm_head), never the trunk's streams."""
    logits, hyper = main_forward(params, table, cfg, tokens, ids)
    main = cross_entropy(logits[:, :-1], tokens[:, 1:])
    if not with_mtp:
        return main, jnp.float32(0)
    draft = mtp_logits(params, cfg, jax.lax.stop_gradient(hyper), tokens)
    return main, cross_entropy(draft, tokens[:, 2:])


@dataclasses.dataclass(frozen=True)
class Windows:
    """Random training windows [batch, seq_len] cut from one token stream (documents joined by EOS)."""

    stream: np.ndarray
    seq_len: int
    batch_size: int

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        starts = rng.integers(0, len(self.stream) - self.seq_len, self.batch_size)
        return np.stack([self.stream[s : s + self.seq_len] for s in starts]).astype(np.int32)

    def all_windows(self) -> np.ndarray:
        """Every non-overlapping window (for evaluation), [N, seq_len]."""
        n = len(self.stream) // self.seq_len
        return self.stream[: n * self.seq_len].reshape(n, self.seq_len).astype(np.int32)


def token_stream(docs: Sequence[Sequence[int]], eos: int) -> np.ndarray:
    out: list[int] = []
    for d in docs:
        out.extend(d)
        out.append(eos)
    return np.asarray(out, np.int64)


# ---- train_mtp ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MTPTrainResult:
    """`params`: the new MTP head (same tree as `model.params["mtp"]`); `losses`: per step; acceptance before /
    after on the training windows (teacher-forced, see `mtp_acceptance`)."""

    params: dict
    losses: list[float]


def _tokenize(model, texts) -> list[list[int]]:
    docs = []
    tok = None
    for t in texts:
        if isinstance(t, str):
            if tok is None:
                from .tokenizer import Tokenizer

                if model.path is None:
                    raise ValueError("texts are strings but the model has no checkpoint directory with a tokenizer")
                tok = Tokenizer.from_dir(model.path)
            docs.append(tok.encode(t))
        else:
            docs.append([int(x) for x in t])
    return docs


def _trunk_hidden(model, windows: np.ndarray, chunk: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The frozen model's pre-final-mixer hyper states [N, T, S*H] and greedy next tokens [N, T] for every window
    (computed once)."""
    def run(p, tbl, toks, ids):
        logits, hyper = main_forward(p, tbl, model.cfg, toks, ids)
        return hyper, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    fn = jax.jit(run)
    table = jnp.asarray(np.asarray(model.table), model.dtype) if model.table is not None else jnp.zeros((1, 1))
    hyper, greedy = [], []
    for i in range(0, len(windows), chunk):
        w = windows[i : i + chunk]
        h, g = fn(model.params, table, jnp.asarray(w), jnp.asarray(ngram_ids(model.hasher, w)))
        hyper.append(np.asarray(h))
        greedy.append(np.asarray(g))
    return np.concatenate(hyper), np.concatenate(greedy)


def mtp_acceptance(model, token_ids: Sequence[int], mtp_params: dict | None = None) -> float:
    """Teacher-forced greedy acceptance of one draft token over a text: the fraction of positions p where the
    MTP draft (hidden p, token p+1) equals the model's own greedy choice for p+2 (argmax of its logits at p+1).
    That is exactly when the engine accepts a draft, measured along the text instead of along the model's output."""
    ids = model.check_tokens(token_ids)
    params = model.params if mtp_params is None else {**model.params, "mtp": mtp_params}
    main = model.logits(ids)  # [T, V]
    hyper, _ = model.hidden_and_logits(ids)
    draft = _jit_mtp_logits(params, model.cfg, jnp.asarray(hyper[None]), jnp.asarray(ids[None].astype(np.int32)))[0]
    return float(np.mean(np.argmax(np.asarray(draft), -1) == np.argmax(main[1:-1], -1)))


def train_mtp(model, texts, *, steps: int = 200, seq_len: int = 128, batch_size: int = 8,
              learning_rate: float = 1e-3, seed: int = 0, target: str = "model", progress: bool = True,
              on_step: Callable[[int, float], None] | None = None) -> MTPTrainResult:
    """Fine-tune only the MTP head of a loaded `Model` on `texts` (strings, tokenized with the checkpoint's
    tokenizer, or token-id sequences) with optax AdamW.

    Loss: teacher-forced cross-entropy of the draft for token p+2 given the frozen model's hyper state at p and
    token p+1 (the trunk, embeddings and lm_head stay fixed). The label for p+2 is, with target="model" (default),
    the frozen model's own greedy token there (argmax of its logits at p+1: what a draft must equal to be accepted),
    with target="text" the text's token. On the demo model, 40 steps of target="text" on a held-out file lowered
    its loss but also the acceptance (0.49 -> 0.32): the text is not what a small model predicts. The trunk's states are computed once, in the
    model's dtype; the head trains in float32. Returns the new head; `mtp_checkpoint.write_mtp` saves it.
    """
    if not model.has_mtp:
        raise ValueError("this checkpoint has no MTP head to train")
    docs = _tokenize(model, texts)
    stream = token_stream(docs, model.cfg.eos_token_id)
    if len(stream) < seq_len + 1:
        raise ValueError(f"texts hold {len(stream)} tokens; need more than seq_len={seq_len}")
    if target not in ("model", "text"):
        raise ValueError(f"target must be 'model' or 'text', got {target!r}")
    windows = Windows(stream, seq_len, batch_size).all_windows()
    with training_paths():
        hidden, greedy = _trunk_hidden(model, windows)
    labels = greedy[:, 1:-1] if target == "model" else windows[:, 2:]  # label of draft row p = token p+2
    frozen = {k: v for k, v in model.params.items() if k != "mtp"}
    if any(not isinstance(x, jax.Array) for x in jax.tree.leaves(model.params["mtp"])):
        raise ValueError("train_mtp needs an unquantized MTP head (plain arrays)")
    dtype = model.dtype
    head = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model.params["mtp"])  # float32 master weights
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 10),
                                                                     steps), weight_decay=0.0))
    cfg = model.cfg

    def loss_fn(head, hyper, toks, label):  # computed in the model's dtype, like inference
        draft = mtp_logits({**frozen, "mtp": jax.tree.map(lambda x: x.astype(dtype), head)}, cfg, hyper, toks)
        return cross_entropy(draft, label)

    @jax.jit
    def step(head, opt_state, hyper, toks, label):
        loss, grads = jax.value_and_grad(loss_fn)(head, hyper, toks, label)
        updates, opt_state = opt.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss

    opt_state = opt.init(head)
    rng = np.random.default_rng(seed)
    losses = []
    for i in tqdm(range(steps), desc="train_mtp", disable=not progress):
        pick = rng.integers(0, len(windows), min(batch_size, len(windows)))
        with training_paths():  # traced on the first call
            head, opt_state, loss = step(head, opt_state, jnp.asarray(hidden[pick]), jnp.asarray(windows[pick]),
                                         jnp.asarray(labels[pick]))
        losses.append(float(loss))
        if on_step is not None:
            on_step(i, losses[-1])
    return MTPTrainResult(jax.tree.map(lambda x: x.astype(dtype), head), losses)
