"""The agreed device order after a heal (snapstore._devices): every device
group that holds a replacement's device is new; every process draws the same."""

import dataclasses

import pytest

from snapstore import _devices
from snapstore._jax_compat import cpu_cache_hangs


@dataclasses.dataclass(frozen=True)
class Dev:  # what rekeyed reads of a jax.Device
  id: int


def test_cliques_are_the_groups_of_every_reshape():
  c = _devices.cliques([0, 1, 2, 3])
  assert {(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)} <= c
  assert (1, 0) not in c and (0, 3) not in c


@pytest.mark.parametrize("hosts,per_host", [(4, 2), (3, 2), (8, 1)])
def test_rekeyed_order_has_only_new_groups_with_a_replacement(hosts, per_host):
  devices = [Dev(h * 2048 + j) for h in range(hosts) for j in range(per_host)]
  used = _devices.cliques([d.id for d in devices])  # the default order, used so far
  replaced = {d.id for d in devices[per_host:2 * per_host]}  # host 1 rejoined
  live = {d: (7 if d.id in replaced else 1) for d in devices}
  order = _devices.rekeyed(live, used, replaced)
  assert order is not None and sorted(order, key=lambda d: d.id) == devices
  fresh = [c for c in _devices.cliques([d.id for d in order]) if replaced & set(c)]
  assert fresh and not any(c in used for c in fresh)
  assert _devices.rekeyed(dict(reversed(list(live.items()))), used, replaced) == order
  other = _devices.rekeyed({d: i + 9 for d, i in live.items()}, used, replaced)
  assert other != order  # another incarnation, another draw


def test_two_heals_in_a_row_find_an_order_for_any_incarnations():
  """4 hosts x 2 devices, every group checked (as recovery does): after the
  default order and a first heal's, a second heal always finds an order in
  which no group was used (taking the first order that fitted left none
  about one time in a hundred: seed 81 here)."""
  devices = [Dev(h * 2048 + j) for h in range(4) for j in range(2)]
  every = {d.id for d in devices}
  for seed in range(100):
    used = _devices.cliques([d.id for d in devices])
    for heal in range(2):
      order = _devices.rekeyed({d: seed * 10 + heal + (d.id == 0) for d in devices},
                             used, every)
      assert order is not None, (seed, heal)
      groups = _devices.cliques([d.id for d in order])
      assert not groups & used
      used |= groups


def test_only_cpu_draws_new_device_orders():
  from snapstore import _devices
  assert _devices.rekey_needed("cpu")
  assert not _devices.rekey_needed("gpu") and not _devices.rekey_needed("tpu")


def test_the_live_block_s_failure_is_read_from_the_service_while_in_the_block():
  """An Orbax barrier asks who failed the ``live()`` block it waits in: the
  block state lives here, below both ``InPlace`` and the barrier."""
  from snapstore import recovery

  class Client:  # the coordination service's key-value store
    def key_value_try_get(self, key):
      return {"failed/blk/1": "2"}[key]  # (NOT_FOUND: KeyError here)

  assert recovery.failed_in_block is _devices.failed_in_block
  assert _devices.failed_in_block(Client()) is None  # outside every block
  try:
    _devices.set_block_failure("failed/blk/1")
    assert _devices.failed_in_block(Client()) == "2"
    _devices.set_block_failure("failed/blk/2")
    assert _devices.failed_in_block(Client()) is None  # none failed this block
  finally:
    _devices.set_block_failure(None)


def test_no_order_left_is_none():
  devices = [Dev(0), Dev(1)]
  used = {(0, 1), (1, 0)}
  assert _devices.rekeyed({d: 1 for d in devices}, used, {1}) is None


_CACHED = """
import json, sys
import jax, numpy as np
jax.config.update("jax_num_cpu_devices", int(sys.argv[-2]))
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
if sys.argv[-1] == "share":  # else JAX's own keys
  from snapstore.recovery import cache_keys
  cache_keys.share()
"""


_RING = _CACHED + """
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
order = [jax.devices()[int(i)] for i in sys.argv[2].split(",")]
mesh = Mesh(np.array(order), ("x",))

def ring(a):  # position j gets position j-1's value, and its own index
  b = jax.lax.ppermute(a, "x", [(j, (j + 1) % 8) for j in range(8)])
  return b * 100 + jax.lax.axis_index("x")

f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
y = f(jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("x"))))
print(json.dumps({s.device.id: float(s.data[0]) for s in y.addressable_shards}))
"""


@pytest.mark.parametrize("strip", [True, False])
def test_a_program_cached_for_one_device_order_runs_right_under_another(tmp_path, strip):
  """In-place recovery compiles for a new device order after a heal; with
  the device assignment out of the cache key (CPU), the programs compiled
  before are found in the persistent cache, and the loaded program places
  and exchanges by the new order, device by device."""
  import json
  import subprocess
  import sys
  cache = tmp_path / "cache"

  def run(order: list[int]) -> dict[int, float]:
    out = subprocess.run([sys.executable, "-c", _RING, str(cache), ",".join(map(str, order)),
                          "8", "share" if strip else "keep"],
                         capture_output=True, text=True, timeout=120, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}

  def programs() -> int:
    return len([p for p in cache.iterdir() if p.name.startswith("jit_ring")])

  for n, order in enumerate(([0, 1, 2, 3, 4, 5, 6, 7], [3, 1, 0, 2, 7, 5, 6, 4])):
    got = run(order)
    want = {d: ((j - 1) % 8) * 100.0 + j for j, d in enumerate(order)}
    assert got == want  # each device holds its position's result in this order
    assert programs() == (1 if strip else n + 1)  # stripped: the second run hit


def _need_serialized_topology() -> None:
  import jax
  from jax._src.lib import xla_client
  topology = xla_client.get_topology_for_devices(jax.devices())
  if not hasattr(topology, "serialize"):  # jax 0.10: keys stay per process
    pytest.skip(f"jax {jax.__version__}: a CPU topology cannot be serialized")


_PAIR = _CACHED + """
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(1) if event.endswith("cache_hits") else None)
jax.distributed.initialize(sys.argv[2], 2, int(sys.argv[3]))
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
s = NamedSharding(mesh, P("x"))
x = jax.make_array_from_callback((8,), s, lambda i: np.arange(8.0)[i])
total = jax.jit(lambda a: (a * 3).sum(), in_shardings=s)(x)
print(json.dumps({"hits": len(hits), "total": float(total)}))
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("share", [True, False])
def test_every_process_of_a_job_finds_the_programs_process_0_cached(tmp_path, share):
  _need_serialized_topology()
  if not share and cpu_cache_hangs():
    pytest.skip("this jaxlib hangs a job whose process 0 alone loads a program from the "
                "cache (docs/limits.md, benchmarks.cpu_cache_probe)")
  """JAX lets only process 0 write the persistent cache; on CPU each
  process's key held its own device list, so the others never hit. Shared
  keys: a second run of a 2-process job hits in both processes."""
  import json
  import socket
  import subprocess
  import sys

  def run() -> list[dict]:
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      address = f"127.0.0.1:{sock.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-c", _PAIR, str(tmp_path), address, str(p),
                               "2", "share" if share else "keep"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for p in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]

  first, second = run(), run()
  assert [r["total"] for r in first + second] == [84.0] * 4
  hit = [r["hits"] > 0 for r in second]
  assert hit == ([True, True] if share else [True, False])


def test_a_cpu_topology_without_its_devices_keeps_the_rest():
  import jax
  from jax._src.lib import xla_client

  from snapstore.recovery import cache_keys
  _need_serialized_topology()
  topology = xla_client.get_topology_for_devices(jax.devices()).serialize()
  kept = cache_keys.without_devices(topology)
  assert len(kept) < len(topology)  # 8 device entries gone
  assert cache_keys.without_devices(kept) == kept
  machine = next(p for n, _, p in cache_keys._fields(topology) if n == 9)
  inner = next(p for n, _, p in cache_keys._fields(machine) if n == 2)
  fields = list(cache_keys._fields(inner))
  assert all(raw in kept for n, raw, _ in fields if n != 1)  # the target machine stays
  assert len(topology) - len(kept) >= sum(len(raw) for n, raw, _ in fields if n == 1) > 0
  with pytest.raises(ValueError):
    cache_keys.without_devices(b"\x0f")  # wire type 7
  with pytest.raises(ValueError):
    cache_keys.without_devices(b"\x0a\x05ab")  # a field running past the end


@pytest.mark.parametrize("value", ["0", "-3", "ten", "2.5"])
def test_a_bad_collective_timeout_in_the_environment_is_refused_naming_it(monkeypatch, value):
  from snapstore import recovery
  monkeypatch.setenv(recovery.COLLECTIVE_TIMEOUT_ENV, value)
  with pytest.raises(ValueError, match=recovery.COLLECTIVE_TIMEOUT_ENV):
    recovery.service._timeout_from_env()


def test_the_collective_timeout_comes_from_the_environment_else_30(monkeypatch):
  from snapstore import recovery
  monkeypatch.delenv(recovery.COLLECTIVE_TIMEOUT_ENV, raising=False)
  assert recovery.service._timeout_from_env() == 30
  monkeypatch.setenv(recovery.COLLECTIVE_TIMEOUT_ENV, "7")
  assert recovery.service._timeout_from_env() == 7
