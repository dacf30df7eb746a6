"""train_mtp (optax, MTP head only) on the demo model, and writing the head back into a checkpoint atomically."""

import shutil
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax import mtp_checkpoint
from flashnext_jax.tokenizer import Tokenizer
from flashnext_jax.training import mtp_acceptance, train_mtp

# tools/train_demo.py HELD_OUT_FILES: stdlib files the demo model never saw
HELD_OUT = Path(sysconfig.get_paths()["stdlib"]) / "fractions.py"


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


@pytest.fixture(scope="module")
def held_out(model):
    ids = Tokenizer.from_dir(model.path).encode(HELD_OUT.read_text())
    return ids[:-400], ids[-400:]  # fine-tune on the start of the file, measure on its last 400 tokens


@pytest.fixture(scope="module")
def trained(model, held_out):
    return train_mtp(model, [held_out[0]], steps=40, seq_len=64, batch_size=8, learning_rate=3e-3, progress=False)


def test_train_mtp_lowers_its_loss_and_raises_held_out_acceptance(model, held_out, trained):
    before = mtp_acceptance(model, held_out[1])
    after = mtp_acceptance(model, held_out[1], trained.params)
    assert np.mean(trained.losses[-5:]) < np.mean(trained.losses[:5])
    assert after > before, (before, after)


def test_train_mtp_leaves_the_rest_of_the_model_alone(model, trained):
    assert jax.tree.structure(trained.params) == jax.tree.structure(model.params["mtp"])
    ids = [5, 6, 7, 8, 9]
    np.testing.assert_array_equal(model.logits(ids), fj.load(dtype="float32").logits(ids))


def test_write_mtp_round_trips_through_load(model, trained, tmp_path):
    ckpt = tmp_path / "demo"
    shutil.copytree(model.path, ckpt)
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    written = mtp_checkpoint.write_mtp(ckpt, model.cfg, trained.params)
    assert written == ["model-00002-of-00002.safetensors"]  # the shard holding mtp.*; the other is untouched
    after = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    assert set(after) == set(before) and all(after[n] == before[n] for n in before if n not in written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging or old copy left behind
    reloaded = fj.load(ckpt, dtype="float32")
    want = jax.tree.map(lambda x: np.asarray(x.astype(jax.numpy.bfloat16), np.float32), trained.params)
    got = jax.tree.map(np.asarray, reloaded.params["mtp"])
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_write_mtp_failure_leaves_the_checkpoint_unchanged(model, trained, tmp_path, monkeypatch):
    ckpt = tmp_path / "demo"
    shutil.copytree(model.path, ckpt)
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    import safetensors.numpy

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        mtp_checkpoint.write_mtp(ckpt, model.cfg, trained.params)
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
