"""A step's outputs as the host reads them: copied from the device on first use, and only the ones a commit reads
(the full logits only when a row samples on the host), the few-byte ones together in one transfer."""

from __future__ import annotations

import jax
import numpy as np


RAW_OUTPUTS = ("logits", "draft_logits")  # [B, K1, V] f32 and [B, K1, k, V]: the host reads them only to sample


def crossing_outputs(out: dict, host_logits: bool) -> dict:
    """The step outputs (the model step's, then the sampler's) that cross to the other processes: all of them
    but the raw logits, which cross only in a step where some row samples from them on the host."""
    return {n: a for n, a in out.items() if host_logits or n not in RAW_OUTPUTS}


class HostOutputs:
    """One step's outputs, copied to the host on first use and only the ones used (the full logits only when a
    row samples with a temperature or penalties)."""

    def __init__(self, out: dict):
        self._out, self._host = out, {}  # out: the model step's outputs, then the sampler's (which replace some)

    # the few-byte outputs come over together, by group: one device_get instead of one sync copy each (the logprob
    # outputs only when a row reads logprobs)
    GROUPS = (("_argmax", "_finite", "_sample", "_accept"), ("_logprob", "_logprobs", "_top_ids"))

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._host:
            group = next((g for g in self.GROUPS if name.endswith(g)), None)
            names = [n for n in self._out if n.endswith(group)] if group else [name]
            self._host.update(zip(names, jax.device_get([self._out[n] for n in names])))
        return self._host[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._out[name].shape)


__all__ = ["HostOutputs", "RAW_OUTPUTS", "crossing_outputs"]
