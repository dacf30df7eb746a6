"""Pipeline stages on the devices of several processes, one per host (docs/pipeline.md, "Beyond one host").

Every process runs the same host loop (scheduler, ledger, tickets) over the same requests, added in the same order.
That loop is deterministic given its inputs, and the one input that lives in a single process, the last stage's
outputs, is sent to every process each step; so every process makes the same decisions and each process's ledger
applies the same ops, in the same order, to the stores it holds (invariant 10 of ../shared/docs/state-store.md).
Nothing but jitted collectives crosses a process boundary (gloo on the CPU; no RPC, no sockets of our own):

* `Send`: a stage's hidden state to the next stage, and the last stage's outputs to every process; a process that
  does not hold the data contributes zeros of its known type;
* `Agreement`: once per step, process 0's decisions (a digest of every ticket and every store op so far) against
  which every process checks its own; a process whose step failed says so there, and every process raises;
* `Agreement.share`: process 0's bytes to every process at a step boundary (the server's new requests, aborts and
  frees: serving/multiprocess.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)


def initialize(coordinator_address: str, num_processes: int, process_id: int, timeout_s: int = 300,
               heartbeat_timeout_s: int = 30) -> None:
    """jax.distributed.initialize with the CPU's cross-process collectives (gloo) switched on; call it in every
    process before anything else touches JAX. A short heartbeat timeout: a process whose peer died is ended by the
    coordination service within that time instead of waiting in a collective (its default is 100 s)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)


def add_process_arguments(parser) -> None:
    """`flashnext generate` / `serve` in each of several processes (one per host), stages over all of their
    devices."""
    parser.add_argument("--coordinator-address", metavar="HOST:PORT",
                        help="process 0's address: run one process per host, each with its --process-id "
                             "(docs/pipeline.md, Beyond one host)")
    parser.add_argument("--num-processes", type=int, default=1, help="processes taking part")
    parser.add_argument("--process-id", type=int, default=0, help="this process's index, 0 .. num-processes - 1")


def initialize_from(args) -> None:
    """initialize() from add_process_arguments' options, when a coordinator is given."""
    if args.coordinator_address:
        initialize(args.coordinator_address, args.num_processes, args.process_id)


def owned(devices) -> bool:
    """Whether this process can address every one of `devices` (a stage must be one process's)."""
    return all(d.process_index == jax.process_index() for d in devices)


class Send:
    """`multihost`'s one way across processes, compiled ahead: a tree of arrays of the types `like`, held by the
    process of devices[src], to every process holding one of `devices` (one device each, one per process).

    Built (and compiled: one jitted shard_map + all_gather over a mesh of `devices`) where the engine compiles its
    step programs (pipeline.PipelineRunner.compile_programs), so that a request whose step shapes were precompiled
    compiles nothing here either. Every one of those processes calls it at the same point of its host loop (the
    sender with the arrays, the others with None: they contribute zeros of `like`, made once) and gets its own copy
    on its device of `devices`. Each array crosses as the block of its device in an array over the mesh, tiled
    along its first axis (a step's outputs all lead with the batch), so nothing is reshaped or converted outside
    the one program: booleans cross as uint8 inside it. Empty arrays do not cross (zeros of their shape here: an
    all_gather of one crashed XLA's CPU compiler, a model without MTP has draft logits [B, K1, 0, V]). Dispatch
    is asynchronous, as any jitted call."""

    def __init__(self, like, devices: tuple, src: int):
        mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        if len(mine) != 1:
            raise ValueError(f"send: process {jax.process_index()} holds {len(mine)} of {devices}, expected one")
        self.device, self.sends = devices[mine[0]], mine[0] == src
        leaves, self.treedef = jax.tree.flatten(like)
        self.types = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in leaves]
        if any(not t.shape for t in self.types):
            raise ValueError("send: every array needs a leading axis (the mesh's blocks are tiled along it)")
        self.crossing = [i for i, t in enumerate(self.types) if math.prod(t.shape)]
        self._zeros = None
        self.sharding = NamedSharding(Mesh(np.array(devices), ("p",)), PartitionSpec("p"))

        def send_across_processes(blocks):
            def gather(b):
                wire = jnp.uint8 if b.dtype == jnp.bool_ else b.dtype
                whole = jax.lax.all_gather(b.astype(wire), "p", tiled=True)
                return whole[src * len(b): (src + 1) * len(b)].astype(b.dtype)
            return [gather(b) for b in blocks]
        program = jax.jit(jax.shard_map(send_across_processes, mesh=self.sharding.mesh, in_specs=self.sharding.spec,
                                        out_specs=self.sharding.spec))
        n = len(devices)  # the arrays over the mesh: every process's block of each crossing array, tiled
        self.tiled = [jax.ShapeDtypeStruct((n * t.shape[0], *t.shape[1:]), t.dtype, sharding=self.sharding)
                      for t in map(self.types.__getitem__, self.crossing)]
        self.program = program.lower(self.tiled).compile()

    def __call__(self, tree=None):
        """The sender's arrays (tree: of `like`'s structure) or None elsewhere -> this process's copy."""
        if self._zeros is None:  # transfers, not programs (jnp.zeros would compile one per shape)
            self._zeros = [None if self.sends and i in self.crossing else
                           jax.device_put(np.zeros(t.shape, t.dtype), self.device) for i, t in enumerate(self.types)]
        given = jax.tree.leaves(tree) if self.sends else self._zeros
        out = list(self._zeros)
        blocks = [jax.make_array_from_single_device_arrays(t.shape, self.sharding,
                                                           [jax.device_put(given[i], self.device)])
                  for i, t in zip(self.crossing, self.tiled)]
        for i, o in zip(self.crossing, self.program(blocks)):
            out[i] = o.addressable_shards[0].data
        return self.treedef.unflatten(out)


class PeerFailed(RuntimeError):
    """Another process's engine step failed (its own error is in its own output)."""


class Diverged(RuntimeError):
    """Another process made other decisions than process 0: the processes did not add the same requests in the
    same order, or their host loops differ."""


@dataclasses.dataclass
class Agreement:
    """Once per engine step, every process's digest of its decisions so far (each step's ticket, each store op its
    ledger applied) beside process 0's, and whether its step failed: all-gathered, so every process sees the same
    and they all raise together. A failure is told only at a step boundary (`safe`): between the agreement and
    the end of a launch the peers wait in the step's own collectives, where a failing process can only leave
    (they then see its connection close, or the coordination service ends them after the heartbeat timeout)."""

    decisions: "hashlib._Hash" = dataclasses.field(default_factory=lambda: hashlib.blake2b(digest_size=16))
    safe: bool = True
    told: bool = False

    def agree(self, step_id: int, ticket, op_digest: bytes):
        self.decisions.update(repr((step_id, ticket)).encode() + op_digest)
        self._gather(False)
        self.safe = False  # the step's collectives follow

    def launched(self):
        self.safe = True

    def failed(self, error: BaseException):
        """Tell the peers this process's step failed (once, and only at a step boundary)."""
        if self.told or not self.safe or isinstance(error, (PeerFailed, Diverged)):
            return
        self.told = True
        try:
            self._gather(True)
        except Exception as e:  # noqa: BLE001 - the peers may be gone already; the original error is what matters
            log.warning("could not tell the other processes of this failure: %s", e)

    def share(self, data: bytes | None) -> bytes:
        """Process 0's `data` to every process (the others pass None), called by every process at the same step
        boundary. Its first collective is the agreement's own gather (which carries the length), so a peer that
        failed and tells it there (`failed`) meets this process in the same collective: it raises PeerFailed here
        instead of the two waiting in different collectives. The bytes then cross in one broadcast, padded to a
        power of two (a few compiled shapes); nothing crosses when process 0 has nothing to say."""
        if data is not None and jax.process_index() != 0:
            raise ValueError("only process 0 shares its data; the other processes pass None")
        size = int(self._gather(False, len(data or b""))[0, -1])
        if not size:
            return b""
        block = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
        if data is not None:
            block[:size] = np.frombuffer(data, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(block))[:size].tobytes()

    def _gather(self, failed: bool, size: int = 0) -> np.ndarray:
        """Every process's [failed, digest..., size] (size: the bytes `share` sends, process 0's counts)."""
        mine = np.frombuffer(self.decisions.digest(), np.int32)
        rows = multihost_utils.process_allgather(np.concatenate([[int(failed)], mine, [size]]).astype(np.int32))
        me = jax.process_index()
        bad = [p for p in range(len(rows)) if rows[p, 0] and p != me]
        if bad and not failed:
            self.told = True
            raise PeerFailed(f"process {bad[0]}'s engine step failed (its error is in its own output)")
        apart = [p for p in range(len(rows)) if not np.array_equal(rows[p, 1:-1], rows[0, 1:-1])]
        if apart and not failed:
            self.told = True
            raise Diverged(f"process {apart[0]}'s decisions differ from process 0's: every process must add the same "
                           "requests with the same parameters, in the same order")
        return rows

    def smallest(self, value: int) -> int:
        """The least of every process's `value` (the page pool: sized from each process's memory, used by all)."""
        return int(np.min(multihost_utils.process_allgather(np.asarray([value], np.int64))))


__all__ = ["Agreement", "Diverged", "PeerFailed", "add_process_arguments", "initialize", "initialize_from", "owned",
           "Send"]
