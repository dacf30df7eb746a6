"""Two processes on localhost, one CPU device each (jax.distributed.initialize): can a stage's hidden state cross
from process 0's device to process 1's? Tries (a) jax.device_put to the other process's device, (b) a jitted
shard_map + ppermute over the 2-device global mesh. Prints one JSON line per process. Usage (both at once):
  python tools/pp_two_process_probe.py 0 PORT & python tools/pp_two_process_probe.py 1 PORT"""

import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def main(pid: int, port: int):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    res = {"process": pid, "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
           "local": [str(d) for d in jax.local_devices()]}
    other = [d for d in jax.devices() if d.process_index != pid][0]
    x = jnp.arange(8.0) + pid
    try:
        y = jax.device_put(x, other)
        res["device_put_to_other_process"] = "ok " + str(y.devices())
    except Exception as e:  # noqa: BLE001
        res["device_put_to_other_process"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        mesh = Mesh(np.array(jax.devices()), ("stage",))
        sh = NamedSharding(mesh, P("stage"))
        glob = jax.make_array_from_single_device_arrays((16,), sh, [jax.device_put(x, jax.local_devices()[0])])

        @jax.jit
        def send(a):  # stage 0's rows to stage 1 (and 1's to 0): the hidden-state hand-over as a collective
            return jax.shard_map(lambda b: jax.lax.ppermute(b, "stage", [(0, 1), (1, 0)]), mesh=mesh,
                                 in_specs=P("stage"), out_specs=P("stage"))(a)
        out = send(glob)
        got = np.asarray(out.addressable_shards[0].data)
        res["ppermute"] = "ok" if np.array_equal(got, np.arange(8.0) + (1 - pid)) else f"wrong {got}"
    except Exception as e:  # noqa: BLE001
        res["ppermute"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    print(json.dumps(res), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
