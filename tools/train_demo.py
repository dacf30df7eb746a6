#!/usr/bin/env python
"""Train the embedded demo model (flashnext_jax/demo_model/) with optax on the machine's Python standard library.

Run (the project venv: jax, optax, tokenizers, tqdm, matplotlib = the `train` extra):
    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/train_demo.py [--steps N] [--seed S] [--fixtures-python PY]
    [--stage all|prepare|train|finish]: prepare = steps 1-2 (writes build/demo_train/corpus.npz), train = step 3
    (jax + optax only: runs on a GPU machine without `tokenizers`), finish = step 4 (docs/demo-model.md).

Steps (deterministic for a given seed, Python version and jax version):
  1. corpus: the interpreter's own stdlib (`CORPUS_FILES` below: pydoc_data/topics.py = the language reference
     topics as plain English text, a fixed list of documented pure-Python modules, LICENSE.txt), PSF licence;
     `HELD_OUT_FILES` are never trained on (held-out loss, train_mtp tests);
  2. a byte-level BPE tokenizer (`tokenizers`, vocab 512 incl. 3 special tokens; tools/demo_spec.py);
  3. the model (tools/demo_spec.py TEXT_CONFIG: GDN, QSA with a binding budget, MoE, PLE n-gram table,
     hyper-connections, MTP head) trained with AdamW through the project's own forward (flashnext_jax/training.py):
     next-token loss + MTP next-next-token loss;
  4. with build/demo_train/{weights.safetensors (CausalLM names, fp32), tokenizer.json, train_log.json}: writes
     docs/demo-model-loss.png, then runs tools/make_fixtures.py --trained build/demo_train in the fixtures venv
     (transformers), which writes the release layout flashnext_jax/demo_model/, tests/fixtures/tiny_causal/ and the
     transformers reference outputs (skip with --no-fixtures).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("FLASHNEXT_KERNELS", "reference")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from demo_spec import EOS_ID, MTP_CONFIG, TEXT_CONFIG, train_tokenizer  # noqa: E402
from flashnext_jax.config import from_hf_config  # noqa: E402
from flashnext_jax.ple import NgramHasher  # noqa: E402
from flashnext_jax.training import Windows, lm_losses, ngram_ids, token_stream, training_paths  # noqa: E402
from flashnext_jax.weights import build_params, expected_tensors, orient, param_path  # noqa: E402

OUT = ROOT / "build" / "demo_train"
LOSS_PNG = ROOT / "docs" / "demo-model-loss.png"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Plain English (the language reference as pydoc serves it) + well-documented pure-Python modules.
CORPUS_FILES = ["pydoc_data/topics.py", "LICENSE.txt", "textwrap.py", "json/__init__.py", "json/decoder.py",
                "json/encoder.py", "argparse.py", "collections/__init__.py", "functools.py", "pathlib/_local.py",
                "random.py", "string.py", "difflib.py", "heapq.py", "contextlib.py", "dataclasses.py", "enum.py",
                "shutil.py", "tempfile.py", "logging/__init__.py", "calendar.py", "csv.py", "pprint.py", "abc.py",
                "numbers.py", "operator.py", "copy.py", "queue.py", "sched.py", "typing.py", "inspect.py",
                "locale.py", "gettext.py", "glob.py", "fnmatch.py", "datetime.py", "_pydatetime.py", "ast.py",
                "base64.py", "configparser.py", "getopt.py", "shlex.py", "subprocess.py", "threading.py",
                "weakref.py", "zipfile/__init__.py", "tarfile.py", "smtplib.py", "ftplib.py", "imaplib.py",
                "poplib.py", "http/client.py", "http/server.py", "urllib/parse.py", "urllib/request.py",
                "email/message.py", "email/utils.py", "email/header.py", "mailbox.py", "nntplib.py" ,
                "optparse.py", "pdb.py", "pickle.py", "platform.py", "plistlib.py", "pydoc.py", "quopri.py",
                "selectors.py", "socket.py", "socketserver.py", "statistics.py", "tokenize.py", "trace.py",
                "traceback.py", "turtle.py", "unittest/case.py", "uuid.py", "wave.py", "zipapp.py"]
HELD_OUT_FILES = ["fractions.py", "bisect.py", "colorsys.py", "graphlib.py", "reprlib.py", "stat.py"]


def read_files(names: list[str]) -> list[str]:
    out = []
    for n in names:
        p = STDLIB / n
        if p.exists():  # a module missing from this Python version is skipped (recorded in train_log.json)
            out.append(p.read_text(encoding="utf-8", errors="replace"))
    return out


def hf_text_config() -> dict:
    """TEXT_CONFIG in the form flashnext_jax's parser reads (the CausalLM form + the MTP keys of the release)."""
    return {**TEXT_CONFIG, "model_type": "qwen4_exp_text", "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False, "mtp": MTP_CONFIG}


# ---- init ---------------------------------------------------------------------------------------------------
def init_tensor(name: str, shape: tuple, rng: np.random.Generator, n_layers: int) -> np.ndarray:
    """Canonical (torch-orientation) tensor -> initial value. Zero-centred (1 + w) norms start at 0, the GDN
    gated norm at 1, decays mild (A in [0.02, 0.3] as the random fixtures: transformers' chunked kernel stays
    within 1e-6 of the recurrent one), projections ~ 1/sqrt(fan_in), output projections scaled by 1/sqrt(2L)."""
    leaf = name.rsplit(".", 2)
    normal = lambda std: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    if name.endswith("linear_attn.norm.weight"):
        return np.ones(shape, np.float32)
    if len(shape) == 1 and "norm" in name:
        return np.zeros(shape, np.float32)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.02, 0.3, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return np.zeros(shape, np.float32)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / np.sqrt(shape[-1]))
    if name == "embed_tokens.weight":
        return normal(1.0)
    fan_in = shape[-1]
    std = 1.0 / np.sqrt(fan_in)
    if leaf[-2] in ("o_proj", "out_proj", "down_proj") or name.endswith("experts.down_proj"):
        std /= np.sqrt(2 * n_layers)
    return normal(std)


def init_params(cfg, seed: int):
    rng = np.random.default_rng(seed)
    specs = expected_tensors(cfg, with_mtp=True)
    tensors = {n: init_tensor(n, s, rng, cfg.num_hidden_layers) for n, s in sorted(specs.items())}
    hasher = NgramHasher(cfg)
    table = (rng.standard_normal((hasher.padded_rows, cfg.ngram_row_width)) * 1.0).astype(np.float32)
    return build_params(cfg, tensors, jnp.float32, fuse=False), jnp.asarray(table)


def export_tensors(cfg, params: dict, table) -> dict[str, np.ndarray]:
    """params (unfused, unstacked) -> canonical tensors in torch orientation (inverse of `weights.orient`)."""
    out = {}
    for name, shape in expected_tensors(cfg, with_mtp=True).items():
        node = params
        for key in param_path(name):
            node = node[int(key)] if key.isdigit() else node[key]
        value = np.asarray(node, np.float32)
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            value = value.swapaxes(-1, -2)
        elif name.endswith("conv1d.weight"):
            value = value[:, None, :]
        assert value.shape == tuple(shape), (name, value.shape, shape)
        assert np.array_equal(np.asarray(orient(name, value)), np.asarray(node)), name
        out[name] = np.ascontiguousarray(value)
    layer = cfg.ple_layers[0]
    out[f"layers.{layer}.ple.ple_embedding.ngram_embedding.weight"] = np.asarray(table, np.float32)
    return out


# ---- training -----------------------------------------------------------------------------------------------
def make_step(cfg, opt, mtp_weight: float):
    def loss_fn(trainable, tokens, ids):
        params, table = trainable
        main, mtp = lm_losses(params, table, cfg, tokens, ids)
        return main + mtp_weight * mtp, (main, mtp)

    @jax.jit
    def step(trainable, opt_state, tokens, ids):
        (_, (main, mtp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, tokens, ids)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, main, mtp

    @jax.jit
    def evaluate(trainable, tokens, ids):
        return lm_losses(trainable[0], trainable[1], cfg, tokens, ids)

    return step, evaluate


def plot_losses(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = np.arange(1, len(log["main_loss"]) + 1)
    w = min(20, len(steps))
    smooth = lambda x: np.convolve(x, np.ones(w) / w, mode="valid")  # noqa: E731
    ax.plot(steps, log["main_loss"], alpha=0.25, color="C0")
    ax.plot(steps[w - 1:], smooth(log["main_loss"]), color="C0", label="next token (train)")
    ax.plot(steps, log["mtp_loss"], alpha=0.25, color="C1")
    ax.plot(steps[w - 1:], smooth(log["mtp_loss"]), color="C1", label="MTP: token after next (train)")
    for key, color, label in (("held_out_main", "C2", "next token (held-out)"),
                              ("held_out_mtp", "C3", "MTP (held-out)")):
        pts = log["evals"]
        ax.plot([p["step"] for p in pts], [p[key] for p in pts], "o-", color=color, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"demo model: {log['n_params']:,} params, {log['tokens_seen']:,} tokens, "
                 f"{log['train_seconds']:.0f} s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def prepare(out: Path) -> None:
    """Stage 1 (needs `tokenizers`): corpus -> OUT/tokenizer.json + OUT/corpus.npz (train and held-out tokens)."""
    train_texts, held_texts = read_files(CORPUS_FILES), read_files(HELD_OUT_FILES)
    tok = train_tokenizer(train_texts)
    encode = lambda texts: [tok.encode(t).ids for t in texts]  # noqa: E731
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    np.savez(out / "corpus.npz", train=token_stream(encode(train_texts), EOS_ID),
             held=token_stream(encode(held_texts), EOS_ID), python=sys.version.split()[0],
             files=np.array([n for n in CORPUS_FILES if (STDLIB / n).exists()]))


def train(args) -> None:
    """Stage 2 (jax + optax only, so it also runs on a GPU machine without `tokenizers`): OUT/corpus.npz ->
    OUT/weights.safetensors (CausalLM names, fp32) + OUT/train_log.json."""
    corpus = np.load(args.out / "corpus.npz")
    stream, held = corpus["train"], corpus["held"]
    cfg = from_hf_config(hf_text_config())
    hasher = NgramHasher(cfg)
    params, table = init_params(cfg, args.seed)
    trainable = (params, table)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
    print(f"corpus: {len(corpus['files'])} stdlib files of Python {corpus['python']}, {len(stream):,} tokens "
          f"(held-out {len(held):,}); model {n_params:,} params; {jax.devices()[0].device_kind}", flush=True)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 20), args.steps, args.lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    opt_state = opt.init(trainable)
    step, evaluate = make_step(cfg, opt, args.mtp_weight)
    windows = Windows(stream, args.seq_len, args.batch_size)
    held_windows = Windows(held, args.seq_len, args.batch_size).all_windows()[: 2 * args.batch_size]
    held_ids = ngram_ids(hasher, held_windows)
    rng = np.random.default_rng(args.seed)
    log = {"seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
           "lr": args.lr, "mtp_weight": args.mtp_weight, "python": str(corpus["python"]), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "corpus_files": [str(n) for n in corpus["files"]],
           "held_out_files": HELD_OUT_FILES, "corpus_tokens": int(len(stream)), "n_params": n_params,
           "main_loss": [], "mtp_loss": [], "evals": []}
    t_train = time.time()
    bar = tqdm(range(1, args.steps + 1), desc="train demo", unit="step", mininterval=5)
    losses = []  # device scalars, read back in groups so the host never waits on each step
    with training_paths():  # the jitted step and evaluation are traced inside (first call)
        for i in bar:
            tokens = windows.sample(rng)
            trainable, opt_state, main, mtp = step(trainable, opt_state, jnp.asarray(tokens),
                                                   jnp.asarray(ngram_ids(hasher, tokens)))
            losses.append((main, mtp))
            if i % 50 == 0 or i == args.steps:
                log["main_loss"] += [float(m) for m, _ in losses]
                log["mtp_loss"] += [float(p) for _, p in losses]
                losses = []
                bar.set_postfix(loss=f"{log['main_loss'][-1]:.3f}", mtp=f"{log['mtp_loss'][-1]:.3f}")
            if i == 1:
                log["first_step_seconds"] = time.time() - t_train  # mostly the compile
            if i % args.eval_every == 0 or i == args.steps:
                hm, hp = evaluate(trainable, jnp.asarray(held_windows), jnp.asarray(held_ids))
                log["evals"].append({"step": i, "held_out_main": float(hm), "held_out_mtp": float(hp)})
                tqdm.write(f"step {i}: held-out loss {float(hm):.3f}, MTP {float(hp):.3f}")
    log["train_seconds"] = time.time() - t_train
    log["tokens_seen"] = args.steps * args.batch_size * args.seq_len

    from safetensors.numpy import save_file

    save_file(export_tensors(cfg, *trainable), str(args.out / "weights.safetensors"))
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"trained in {log['train_seconds']:.0f}s: final loss {np.mean(log['main_loss'][-20:]):.3f}, "
          f"held-out {log['evals'][-1]}; wrote {args.out}")


def finish(args) -> None:
    """Stage 3: the loss curve PNG, then the release layout + transformers fixtures (tools/make_fixtures.py)."""
    plot_losses(json.loads((args.out / "train_log.json").read_text()), LOSS_PNG)
    print(f"wrote {LOSS_PNG}")
    if not args.no_fixtures:
        subprocess.run([args.fixtures_python, str(ROOT / "tools" / "make_fixtures.py"), "--trained", str(args.out)],
                       check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=["all", "prepare", "train", "finish"], default="all",
                    help="all = prepare, train, finish; run `train` alone on a machine without tokenizers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=130)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--fixtures-python", default="/work/venvfx/bin/python",
                    help="Python with torch + transformers that runs tools/make_fixtures.py --trained OUT")
    ap.add_argument("--no-fixtures", action="store_true", help="finish: only the loss curve, no fixtures")
    args = ap.parse_args()
    if args.stage in ("all", "prepare"):
        prepare(args.out)
    if args.stage in ("all", "train"):
        train(args)
    if args.stage in ("all", "finish"):
        finish(args)


if __name__ == "__main__":
    main()
