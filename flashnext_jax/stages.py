"""Pipeline stages: which decoder layers each stage runs and on which devices (docs/pipeline.md).

A `StagePlan` is the one description of a pipeline: consecutive layer ranges that cover the model, one per stage,
and each stage's devices (a sub-mesh; its arrays are replicated over it). The converter writes one directory per
stage from the same partition (`plan_stages`), the engine builds one jitted step and one state store per stage
from it (`pipeline.PipelineRunner`). One stage holding every layer on the default device is today's model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class StagePlanError(ValueError):
    """A pipeline layout that cannot work (the message names the problem in one line)."""


def partition_layers(num_layers: int, num_stages: int = 1, partition: Sequence[int] | None = None) -> list[range]:
    """Consecutive layer ranges, one per stage. Default: an even split, the first `num_layers % num_stages` stages
    one layer longer (48 over 3 -> 16/16/16, 8 over 3 -> 3/3/2)."""
    if num_stages < 1:
        raise StagePlanError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if partition is None:
        q, r = divmod(num_layers, num_stages)
        partition = [q + (s < r) for s in range(num_stages)]
    parts = [int(p) for p in partition]
    text = ",".join(map(str, parts))
    if len(parts) != num_stages:
        raise StagePlanError(f"layer partition {text} has {len(parts)} stages, pipeline_parallel_size is {num_stages}")
    if any(p <= 0 for p in parts):
        raise StagePlanError(f"layer partition {text}: stage {[p <= 0 for p in parts].index(True)} would hold no "
                             f"layers (every stage needs at least one)")
    if sum(parts) != num_layers:
        raise StagePlanError(f"layer partition {text} sums to {sum(parts)}, the model has {num_layers} layers")
    bounds = np.cumsum([0] + parts)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    layers: range
    devices: tuple  # jax.Device, one or more (the stage's sub-mesh)

    @property
    def mesh(self) -> Mesh:
        return Mesh(np.array(self.devices), ("stage",))

    @property
    def sharding(self) -> NamedSharding:
        """Where the stage's params, store and inputs live: replicated over its devices."""
        return NamedSharding(self.mesh, PartitionSpec())


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    num_layers: int

    @property
    def size(self) -> int:
        return len(self.stages)

    @staticmethod
    def build(num_layers: int, pipeline_parallel_size: int = 1, partition: Sequence[int] | None = None,
              devices: Sequence | None = None, devices_per_stage: int = 1) -> "StagePlan":
        """Stage s gets layers partition[s] and devices[s * devices_per_stage: (s + 1) * devices_per_stage]
        (default devices: jax.devices(), every process's, in order)."""
        ranges = partition_layers(num_layers, pipeline_parallel_size, partition)
        devices = list(jax.devices() if devices is None else devices)
        need = pipeline_parallel_size * devices_per_stage
        if need > len(devices):
            raise StagePlanError(f"pipeline_parallel_size {pipeline_parallel_size} x {devices_per_stage} device(s) "
                                 f"per stage needs {need} devices, {len(devices)} available "
                                 f"({devices[0].platform if devices else 'none'})")
        stages = tuple(Stage(s, r, tuple(devices[s * devices_per_stage: (s + 1) * devices_per_stage]))
                       for s, r in enumerate(ranges))
        return StagePlan(stages, num_layers)


def plan_stages(pp_partition: Sequence[int] | None, num_layers: int) -> list[dict]:
    """The converter's per-stage directory layout for a partition (None: one stage): stage_<s>/ holds layers
    [start, stop), stage 0 also the embeddings, the last stage the head and MTP."""
    ranges = partition_layers(num_layers, len(pp_partition) if pp_partition else 1, pp_partition)
    last = len(ranges) - 1
    return [{"index": s, "dir": f"stage_{s}", "layers": [r.start, r.stop], "embeddings": s == 0, "head": s == last,
             "mtp": s == last} for s, r in enumerate(ranges)]


__all__ = ["Stage", "StagePlan", "StagePlanError", "partition_layers", "plan_stages"]


# ---- command-line options (flashnext generate / serve)
def _partition_arg(text: str) -> tuple[int, ...]:
    import argparse

    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 16,17,15, got {text!r}") from None


def add_pipeline_arguments(parser) -> None:
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="pipeline stages, each on its own device (docs/pipeline.md)")
    parser.add_argument("--pp-layer-partition", type=_partition_arg, default=None, metavar="N0,N1,...",
                        help="decoder layers per stage, e.g. 16,17,15 (default: an even split)")


def pipeline_kwargs(args) -> dict:
    """LLM keyword arguments from add_pipeline_arguments' options."""
    return {"pipeline_parallel_size": args.pipeline_parallel_size, "pp_layer_partition": args.pp_layer_partition}
