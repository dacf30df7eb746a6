"""The decoder layers' weights stacked over layers: a few dozen arrays instead of one per layer and tensor.

Why: every array argument of a jitted call costs host time on each call (buffer bookkeeping in the runtime):
~2.3 us per array on the H200 (bench/results/dispatch_probe.json). The real model's per-layer params are 1659
arrays, ~4 ms of a ~13 ms engine step spent before the step even starts on the GPU, plus ~1.2 ms to flatten the
tree in Python. Stacked, the 48 layers are ~80 arrays.

`stack_layers(layers)` groups the layers whose param trees are alike (same structure, shapes, dtypes and
quantization formats: the GDN layers, the QSA layers, ...) and stacks each leaf of a group into one [L, ...]
array. `LayerStack[i]` is layer i's param tree again, built inside the jitted function from the stacked arrays:
plain arrays are sliced (`a[j]`: free where XLA fuses it into the consumer), quantized weights become
`LayerSlice`s that the Pallas kernels read in place (a slice handed to a Pallas call would be a copy).
The model code iterates `params["layers"]` the same way whether it is a list or a LayerStack.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_layout import LayerSlice, QuantizedWeight


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _leaf_signature(x) -> tuple:
    if isinstance(x, QuantizedWeight):
        return ("q", x.bits, x.group_size, x.k, x.n, tuple((p.shape, str(p.dtype)) for p in x.planes),
                x.scales.shape, str(x.scales.dtype))
    return ("a", tuple(x.shape), str(x.dtype))


def layer_signature(layer: Any) -> tuple:
    """Layers with equal signatures can share one stack."""
    leaves, treedef = jax.tree.flatten(layer, is_leaf=_is_quantized)
    return (treedef, tuple(_leaf_signature(x) for x in leaves))


def _stack(xs: list, free_sources: bool):
    if isinstance(xs[0], QuantizedWeight):
        planes = tuple(_stack([x.planes[i] for x in xs], free_sources) for i in range(len(xs[0].planes)))
        return dataclasses.replace(xs[0], planes=planes, scales=_stack([x.scales for x in xs], free_sources))
    if isinstance(xs[0], np.ndarray):
        return np.stack(xs)
    out = jnp.stack(xs)
    if free_sources:  # the loader's own arrays: peak memory is the model plus one stacked leaf, not twice the model
        out.block_until_ready()  # the stack is dispatched asynchronously: its sources are deleted only once read
        for x in xs:
            x.delete()
    return out


@jax.tree_util.register_pytree_node_class
class LayerStack:
    """The decoder layers' params as stacked groups; `stack[i]` / iteration give per-layer param trees."""

    def __init__(self, groups: tuple, where: tuple[tuple[int, int], ...]):
        self.groups = groups  # one param tree per group, every leaf [L_group, ...]
        self.where = where  # layer -> (group, index in the group)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, layer: int) -> Any:
        g, j = self.where[layer]

        def view(x):
            return LayerSlice(x, j) if isinstance(x, QuantizedWeight) else x[j]
        return jax.tree.map(view, self.groups[g], is_leaf=_is_quantized)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def select(self, layers: range) -> "LayerStack":
        """The stack of layers `layers` only (a pipeline stage's share): each group cut to its members in the range
        (consecutive within the group, since a group lists its layers in order); groups left empty are dropped."""
        keep = {}  # group -> (first, stop) member index
        for layer in layers:
            g, j = self.where[layer]
            a, _ = keep.get(g, (j, j))
            keep[g] = (a, j + 1)
        order = sorted(keep)

        def cut(x, a, b):
            if isinstance(x, QuantizedWeight):
                return dataclasses.replace(x, planes=tuple(p[a:b] for p in x.planes), scales=x.scales[a:b])
            return x[a:b]
        groups = tuple(jax.tree.map(lambda x: cut(x, *keep[g]), self.groups[g], is_leaf=_is_quantized) for g in order)
        where = tuple((order.index(self.where[layer][0]), self.where[layer][1] - keep[self.where[layer][0]][0])
                      for layer in layers)
        return LayerStack(groups, where)

    def tree_flatten(self):
        return self.groups, self.where

    @classmethod
    def tree_unflatten(cls, where, groups):
        return cls(tuple(groups), where)


def stack_layers(layers: list, *, free_sources: bool = False) -> LayerStack:
    """List of per-layer param trees -> LayerStack. free_sources: delete each per-layer device array once it is
    stacked, and release host (numpy) ones, emptying `layers` (only for arrays nobody else holds, e.g. right after
    loading)."""
    if isinstance(layers, LayerStack):
        return layers
    signatures: dict[tuple, int] = {}
    members: list[list[int]] = []
    where = []
    for i, layer in enumerate(layers):
        g = signatures.setdefault(layer_signature(layer), len(members))
        if g == len(members):
            members.append([])
        where.append((g, len(members[g])))
        members[g].append(i)
    layer = None  # the loop's last layer would otherwise stay referenced until the end (free_sources)
    groups = []
    for idx in members:
        flat = [jax.tree.flatten(layers[i], is_leaf=_is_quantized) for i in idx]
        leaves, treedef = [lv for lv, _ in flat], flat[0][1]
        del flat
        if free_sources:  # host sources go with their last reference: drop the layer trees' own
            for i in idx:
                layers[i] = None
        stacked = []
        for n in range(len(leaves[0])):
            stacked.append(_stack([lv[n] for lv in leaves], free_sources))
            if free_sources:  # peak: the model plus one stacked leaf, not twice the model
                for lv in leaves:
                    lv[n] = None
        groups.append(jax.tree.unflatten(treedef, stacked))
    return LayerStack(tuple(groups), tuple(where))


def with_stacked_layers(params: dict, *, free_sources: bool = False) -> dict:
    """params with params["layers"] as a LayerStack (unchanged when it already is one)."""
    return {**params, "layers": stack_layers(params["layers"], free_sources=free_sources)}


def build_stacked_on_host(build: Callable[[], dict], device=None) -> dict:
    """`with_stacked_layers(build())`, with the per-layer arrays built and stacked on the host and each stacked
    leaf moved to `device` (default: jax's default device; "host": left as numpy arrays) once.

    Why: stacked on an accelerator, every stacked leaf is allocated while the per-layer sources still fill the
    device, and freeing the sources leaves holes between the other layers' arrays that no later stack fits in. On
    the H200 that fragmented jax's BFC allocator until a 9.38 GiB stack failed with ~60 GiB free
    (docs/long-context.md); built on the host, the device only ever receives the final arrays. `build` should
    return numpy leaves, which numpy concatenates and stacks (a first version that kept jax CPU arrays took 198 s
    for the real-size random weights on the H200, against 41 s stacking on the device); it may draw arrays
    elsewhere (random weights on the GPU) if it moves each to the host right away (`to_host`)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # a stray jnp op in `build` stays on the host too
        params = with_stacked_layers(build(), free_sources=True)
    if device == "host":
        return params
    params = jax.device_put(params, device or jax.local_devices()[0])  # this process's default device
    jax.block_until_ready(params)
    return params


def to_host(x):
    """A freshly built device array as numpy (see build_stacked_on_host); its device copy is freed with it."""
    return np.asarray(x)
