"""Checkpoint conversion for flashnext-jax: HF quantized / bf16 / fp8 checkpoints -> our format.

API: read_checkpoint(path) and load_converted(path) both return
(hf_config, iterator of (canonical_name, np.ndarray | QuantizedWeight), ngram_table, ngram_scale);
convert(src, dst, ...) writes our format (docs/converter.md); expected_tensors(hf_config) is the canonical set;
read_vision(path) gives the vision tower's tensors (`visual.*`) of either format.
"""

from convert.errors import ConvertError
from convert.readers import open_checkpoint, read_checkpoint, read_vision
from convert.spec import expected_tensors, ngram_table_shape


def load_converted(path, **kw):
    from convert.writer import load_converted as _load

    return _load(path, **kw)


def convert(src, dst, **kw):
    from convert.writer import convert as _convert

    return _convert(src, dst, **kw)


__all__ = ["ConvertError", "read_checkpoint", "read_vision", "load_converted", "convert", "open_checkpoint",
           "expected_tensors", "ngram_table_shape"]
