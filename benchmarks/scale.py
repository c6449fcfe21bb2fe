"""A restore's metadata cost per host against the job's host count N.

``python -m benchmarks.scale`` (JSON to stdout and ``--out``, a PNG with
``--plot``): one host's view of an N-host multi-controller job, N = 8 ...
16,384, through snapstore's own restore decision (:mod:`snapstore._multihost.agree`,
:mod:`snapstore._multihost.sparse`: records, needs, holders, rows, the transfer
rounds), with only the collective replaced by an in-process stand-in.

The stand-in runs the hosts that matter to a case in lockstep threads (the
host measured, the lost hosts, their ring neighbours, one bystander), each
with its own manifests built as a host-files drain builds them, and hands
every one what the real collective would: the gathered records of every
host, the needs and rows of every host, the element-wise minimum. Every
other host is a bystander whose contribution is known without running it:
the same records as any live host (one step pair, one digest), no needs, no
rows, and no holder that beats a neighbour (it holds only its own pieces,
which no lost host needs, and replicated leaves, which the needer's nearer
neighbours hold too). Bytes per host are the buffers the real collective
(:class:`snapstore._multihost.collective.JaxCollective`) would put in and get back.

Not simulated: reading the stores and the point-to-point moves themselves
(their cost is the state bytes a host receives, reported), and JAX's own
per-collective latency.

Each row also times what every *save* adds at that size: the retention
watermark's one reduction (:mod:`snapstore._watermark`), built from the
host's own manifests: ``save_agreement_cpu_s_max`` and its bytes,
``save_agreement_payload``.

State: a MaxText-like unscanned llama (500 leaves: 165 params, Adam mu/nu,
step, count, rng, two scalars), every array FSDP-sharded over all 4N devices
(4 a host), keep=2, one failure domain a host. Cases: ``none`` (nothing
lost), ``one`` (one host lost with its store: its replacement restores),
``two`` (two ring neighbours lost: no step is recoverable, the persistent
tier); for ``replicas=1`` and ``parity k=3``. ``--before N`` also times the
full manifest exchange (every host's manifests gathered, decoded and
planned, as before the sparse path) up to N hosts, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

LOCAL = 4
CHUNK = 16 << 20
STEPS = (1000, 1100)
D, QH, KVH, HD, MLP, VOCAB, LAYERS = 8192, 64, 8, 128, 28672, 128256, 18


# ------------------------------------------------------------------ layout
def _params() -> list[tuple[str, tuple[int, ...], int]]:
  out = [("params/token_embedder/embedding", (VOCAB, D), 1)]
  for i in range(LAYERS):
    p = f"params/decoder/layers_{i}"
    out += [(f"{p}/mlp/wi_0/kernel", (D, MLP), 0), (f"{p}/mlp/wi_1/kernel", (D, MLP), 0),
            (f"{p}/mlp/wo/kernel", (MLP, D), 1), (f"{p}/post_norm/scale", (D,), 0),
            (f"{p}/pre_norm/scale", (D,), 0), (f"{p}/attn/key/kernel", (D, KVH, HD), 0),
            (f"{p}/attn/out/kernel", (QH, HD, D), 2), (f"{p}/attn/query/kernel", (D, QH, HD), 0),
            (f"{p}/attn/value/kernel", (D, KVH, HD), 0)]
  return [*out, ("params/decoder/norm/scale", (D,), 0),
          ("params/decoder/logits/kernel", (D, VOCAB), 0)]


class Layout:
  """The saved (and target) layout of an N-host job."""

  def __init__(self, n: int):
    from snapstore._tree import LeafKind, LeafSpec
    self.n, devices = n, LOCAL * n
    arrays = []
    for path, shape, axis in _params():
      for prefix in ("", "opt/mu/", "opt/nu/"):
        s = list(shape)
        s[axis] = -(-s[axis] // devices) * devices
        arrays.append((prefix + path, tuple(s), axis))
    arrays.sort()
    self.specs: list[Any] = [LeafSpec(p, LeafKind.ARRAY, "float32", s) for p, s, _ in arrays]
    self.axes: list[int | None] = [a for _, _, a in arrays]
    for path, kind, dtype, shape in (("opt/count", LeafKind.ARRAY, "int32", ()),
                                     ("rng", LeafKind.KEY, "uint32", (2,)),
                                     ("step", LeafKind.ARRAY, "int32", ())):
      self.specs.append(LeafSpec(path, kind, dtype, shape,
                                 "threefry2x32" if kind is LeafKind.KEY else ""))
      self.axes.append(None)
    self.scalars = {}
    for name, value in (("data/epoch", 3), ("data/tokens", 123_456_789_012)):
      self.scalars[len(self.specs)] = value
      self.specs.append(LeafSpec(name, LeafKind.SCALAR))
      self.axes.append(None)

  def index(self, leaf: int, device: int) -> tuple[tuple[int, int], ...]:
    shape, axis = self.specs[leaf].shape, self.axes[leaf]
    if axis is None:
      return tuple((0, d) for d in shape)
    k = shape[axis] // (LOCAL * self.n)
    return tuple((device * k, (device + 1) * k) if a == axis else (0, d)
                 for a, d in enumerate(shape))

  def arrays(self) -> list[int]:
    from snapstore._tree import LeafKind
    return [i for i, s in enumerate(self.specs) if s.kind is not LeafKind.SCALAR]

  def manifest(self, host: int, step: int, slot: int, *, parity: bool, shift: int = 1) -> Any:
    """Host ``host``'s manifest of ``step``, as a host-files drain makes it:
    its own pieces, then (replicas) those of the host ``shift`` before it
    (one domain a host: 1), owner that host;
    (parity) one block a local device instead."""
    from snapstore._checksum import ChecksumKind
    from snapstore._index import align
    from snapstore._manifest import (
      PARITY_LEAF,
      Manifest,
      member_length,
      pad4_sum,
      piece_row,
      split_parity,
    )
    from snapstore._tree import tree_digest
    rows, off, crc = [], 0, ChecksumKind.CRC32C
    def add(leaf: int, index: Any, owner: int) -> None:
      nonlocal off
      nb = math.prod(b - a for a, b in index) * self.specs[leaf].np_dtype.itemsize
      rows.append(piece_row(leaf, index, off, nb, (0,) * max(1, -(-nb // CHUNK)), owner, crc))
      off += align(nb)
    for leaf in self.arrays():
      first = LOCAL * host
      devs = [first] if self.axes[leaf] is None else range(first, first + LOCAL)
      for d in devs:
        add(leaf, self.index(leaf, d), host)
    prev = (host - shift) % self.n  # (shift: the ring's, hosts_per_domain at save)
    parity_of = {}
    if parity:  # k=3: groups of 4 hosts; a stripe a local device position
      g = host // 4 * 4
      members = tuple(range(g, g + 4))
      sharded = [leaf for leaf in self.arrays() if self.axes[leaf] is not None]
      for j in range(LOCAL):
        layout = tuple(tuple((leaf, self.index(leaf, LOCAL * m + j)) for leaf in sharded)
                       for m in members)
        used = pad4_sum([math.prod(b - a for a, b in idx) * 4 for _, idx in layout[0]])
        length = member_length(used, 3)
        key = (LOCAL * g + j, host - g)
        rows.append(piece_row(PARITY_LEAF, (key,), off, length // 3,
                              (0,) * max(1, -(-(length // 3) // CHUNK)), host, crc))
        off += align(length // 3)
        parity_of[key] = (members, layout, length)
    else:
      for leaf in self.arrays():
        if self.axes[leaf] is not None:
          for d in range(LOCAL * prev, LOCAL * prev + LOCAL):
            add(leaf, self.index(leaf, d), prev)
    table, par = split_parity(rows, parity_of)
    return Manifest(run_id="scale", incarnation=0, step=step, store=host, num_hosts=self.n,
                    tree_digest=tree_digest(self.specs), slot=slot, chunk_bytes=CHUNK,
                    leaves=tuple(self.specs), pieces=table, scalars=dict(self.scalars),
                    extra={"data": {"epoch": 3, "index": 987654}}, parity=par)


class FakeDevice:
  def __init__(self, i: int):
    self.id, self.process_index = i, i // LOCAL


class FakeSharding:
  """What the restore asks of a target's sharding: this host's devices'
  indices (the full map is never asked for)."""

  def __init__(self, layout: Layout, host: int, axis: int | None):
    self.layout, self.host, self.axis = layout, host, axis
    self._key = (layout.n, host, axis)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, FakeSharding) and other._key == self._key

  def addressable_devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
    out = {}
    for d in range(LOCAL * self.host, LOCAL * self.host + LOCAL):
      if self.axis is None:
        out[FakeDevice(d)] = tuple(slice(None) for _ in shape)
      else:
        k = shape[self.axis] // (LOCAL * self.layout.n)
        out[FakeDevice(d)] = tuple(slice(d * k, (d + 1) * k) if a == self.axis else slice(None)
                                   for a in range(len(shape)))
    return out


class Target:
  def __init__(self, sharding: FakeSharding | None):
    self.sharding = sharding


def targets_of(layout: Layout, host: int) -> list[Any]:
  from snapstore._tree import LeafKind
  return [None if s.kind is LeafKind.SCALAR else Target(FakeSharding(layout, host, a))
          for s, a in zip(layout.specs, layout.axes, strict=True)]


# ------------------------------------------------------------ the stand-in
class Lockstep:
  """The collective of the hosts run as threads, bystanders filled in:
  a bystander holds what host 0 holds (the bitmaps of :func:`agree.candidates`
  get its bit where host 0 sets its own), sends no blob (zeros in every
  sum), and never holds a needed piece nearer than a neighbour (it is left
  out of every minimum; the maxima of equal stores are host 0's)."""

  def __init__(self, n: int, hosts: Sequence[int]):
    self.n, self.hosts = n, list(hosts)
    self.bystanders = np.ones(n, bool)
    self.bystanders[self.hosts] = False
    self.barrier = threading.Barrier(len(hosts), action=self._combine)
    self.after = threading.Barrier(len(hosts))
    self.put: dict[int, Any] = {}
    self.kind = ""
    self.out: Any = None

  def _combine(self) -> None:
    vals = list(self.put.values())
    if self.kind == "or":
      out = np.bitwise_or.reduce(vals)
      if np.unpackbits(self.put[0], bitorder="little")[0]:  # host 0 holds: so do they
        bits = np.unpackbits(out, bitorder="little")[:self.n] | self.bystanders
        out = np.packbits(bits, bitorder="little")[:len(out)]
      self.out = out
    elif self.kind == "sum":
      self.out = np.sum(vals, axis=0, dtype=np.uint8)
    elif self.kind == "min":
      self.out = np.minimum.reduce(vals)
    self.put = {}

  def call(self, host: int, kind: str, value: Any) -> Any:
    self.put[host] = value
    self.kind = kind
    self.barrier.wait()
    out = self.out
    self.after.wait()  # every host has read it before the next call
    return out


class SimCollective:
  """:class:`snapstore._multihost.collective.Collective` for one simulated host,
  counting the buffers :class:`JaxCollective` would use."""

  def __init__(self, world: Lockstep, host: int):
    from snapstore._multihost.collective import Traffic
    self.world, self.host, self.num_hosts = world, host, world.n
    self.traffic = Traffic()

  def _count(self, nbytes: int) -> None:
    from snapstore._multihost.collective import bucket
    size = bucket(nbytes) if nbytes else 0
    self.traffic.add(size, size)

  def reduce_or(self, bits: np.ndarray) -> np.ndarray:
    self._count(bits.nbytes)
    return self.world.call(self.host, "or", np.asarray(bits, np.uint8))

  def sum_bytes(self, buf: np.ndarray) -> np.ndarray:
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    self._count(buf.nbytes)
    return self.world.call(self.host, "sum", buf).copy()

  def reduce_min(self, values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, np.int32)
    if values.size:
      self.traffic.add(4 * _bucket(values.size), 4 * _bucket(values.size))
    return self.world.call(self.host, "min", values)

  def permute(self, *a: Any) -> Any:  # pragma: no cover - not simulated
    raise NotImplementedError("the moves are not simulated (their bytes are reported)")


def _bucket(n: int) -> int:
  from snapstore._multihost.collective import bucket
  return bucket(n)


def lockstep(n: int, hosts: Sequence[int], fn: Any) -> list[Any]:
  """``fn(collective)`` on each of ``hosts`` of an ``n``-host job, as
  threads in lockstep (:class:`Lockstep`); their results, in ``hosts``
  order. An error in one is raised here (the others are released)."""
  world = Lockstep(n, hosts)
  results: dict[int, Any] = {}
  errors: list[BaseException] = []

  def one(h: int) -> None:
    try:
      results[h] = fn(SimCollective(world, h))
    except BaseException as e:  # noqa: BLE001 - carried back to the caller
      errors.append(e)
      world.barrier.abort()
      world.after.abort()
  threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  if errors:
    raise errors[0]
  return [results[h] for h in hosts]


# --------------------------------------------------------------- one case
def restore_decision(coll: SimCollective, layout: Layout, manifests: list[Any]) -> dict:
  """What :meth:`snapstore._multihost.peers.Distributed.restore` runs before it reads
  a store: records, maxima, candidates, then the plan of each candidate."""
  from snapstore._multihost import agree, moves, sparse
  from snapstore._switch import collections_paused
  t = time.thread_time()
  with collections_paused(True):
    agree.max64(coll, (STEPS[-1], 0, 1))
    out: dict[str, Any] = {"verdict": "persistent"}
    targets = targets_of(layout, coll.host)
    for cand in agree.candidates(coll, manifests):
      got = sparse.plan(coll, sparse.manifests_at(manifests, cand), cand, layout.specs,
                         targets)
      if isinstance(got, sparse.Lost):
        continue
      if isinstance(got, sparse.Fallback):
        out = {"verdict": "fallback", "why": got.why}
        break
      sent, received = moves.bytes_moved(got, coll.host)
      out = {"verdict": "snapshot", "step": cand.step, "state_sent": sent,
             "state_received": received, "rounds": len(moves.rounds(got))}
      break
  out["cpu_s"] = time.thread_time() - t
  out["payload_sent"], out["payload_received"] = coll.traffic.sent, coll.traffic.received
  out["collectives"] = coll.traffic.calls
  return out


def save_agreement(coll: SimCollective, manifests: list[Any]) -> dict:
  """What every save runs before it evicts anything (:mod:`snapstore._watermark`):
  this host's record from its own manifests, one minimum, the watermark."""
  from snapstore import _watermark
  t = time.thread_time()
  now = STEPS[-1] + 1
  rec = _watermark.record(now, sorted({m.step for m in manifests}), STEPS[0])
  mark = _watermark.settle(now, coll.reduce_min(rec))
  return {"cpu_s": time.thread_time() - t, "payload": coll.traffic.received,
          "watermark": mark}


def run_case(n: int, case: str, redundancy: str) -> dict:
  layout = Layout(n)
  parity = redundancy == "parity"
  lost = {"none": [], "one": [n // 2], "two": [n // 2, n // 2 + 1]}[case]
  hosts = sorted({0, *lost, *[(h + k) % n for h in lost or [0] for k in (1, 2, 3)]})
  stores = {h: [] if h in lost else [layout.manifest(h, s, i, parity=parity)
                                     for i, s in enumerate(STEPS)] for h in hosts}
  tracemalloc.start()
  try:
    results = dict(zip(hosts, lockstep(n, hosts, lambda coll: restore_decision(
        coll, layout, stores[coll.host])), strict=True))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  worst = max(results.values(), key=lambda r: r["cpu_s"])
  saves = lockstep(n, hosts, lambda coll: save_agreement(coll, stores[coll.host]))
  return {"n": n, "case": case, "redundancy": redundancy, "hosts_run": hosts,
          # every save: the retention watermark's one reduction (before the loss)
          "save_agreement_cpu_s_max": round(max(r["cpu_s"] for r in saves), 6),
          "save_agreement_payload": max(r["payload"] for r in saves),
          "verdict": results[hosts[0]]["verdict"],
          "why": results[hosts[0]].get("why"),
          "cpu_s_max": round(worst["cpu_s"], 4),
          "payload_received_max": max(r["payload_received"] for r in results.values()),
          "payload_sent_max": max(r["payload_sent"] for r in results.values()),
          "collectives": worst["collectives"],
          "peak_mb_all_hosts_run": round(peak / 2**20, 1),
          "state_received": {h: r.get("state_received", 0) for h, r in results.items()},
          "state_share_bytes": sum(
              math.prod(b - a for a, b in layout.index(leaf, LOCAL * (n // 2) + j)) * 4
              for leaf in layout.arrays() for j in range(LOCAL))}


# ------------------------------------------------------------- the before
def before(n: int) -> dict:
  """The full exchange, timed as one host runs it: every host's manifests
  gathered (the all-reduce faked by what it returns), decoded, planned for
  one host lost, and the lost pieces found (:func:`exchange.missing_pieces`)."""
  import msgpack

  from snapstore import _planner
  from snapstore._manifest import encode
  from snapstore._multihost import exchange
  from snapstore._switch import collections_paused
  layout = Layout(n)
  lost = n // 2
  blobs = [msgpack.packb([[encode(layout.manifest(h, s, i, parity=False))
                           for i, s in enumerate(STEPS)], [STEPS[-1], 0, 1]])
           if h != lost else msgpack.packb([[], [STEPS[-1], 0, 1]]) for h in range(n)]
  calls = []

  def fake_sum(contribution: np.ndarray) -> np.ndarray:
    if not calls:
      calls.append(1)
      return np.array([len(b) for b in blobs], np.int64).view(np.uint8)
    size = contribution.size // n
    out = np.zeros(contribution.size, np.uint8)
    for i, b in enumerate(blobs):
      out[i * size:i * size + len(b)] = np.frombuffer(b, np.uint8)
    return out
  import jax
  saved = (exchange._sum, jax.process_count, jax.process_index)
  exchange._sum, jax.process_count, jax.process_index = fake_sum, (lambda: n), (lambda: 0)
  tracemalloc.start()
  t = time.process_time()
  try:
    local = [m for m in (layout.manifest(0, s, i, parity=False) for i, s in enumerate(STEPS))]
    manifests, _ = exchange.gather_manifests(local, (STEPS[-1], 0, 1))
    with collections_paused(True):
      plan = _planner.choose(manifests)
      devices = [FakeDevice(i) for i in range(LOCAL * n)]
      for leaf in layout.arrays():
        exchange.missing_pieces(plan, leaf, _FullSharding(layout, devices, layout.axes[leaf]),
                                 tuple(layout.specs[leaf].shape))
    cpu = time.process_time() - t
  finally:
    exchange._sum, jax.process_count, jax.process_index = saved
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return {"n": n, "cpu_s": round(cpu, 3), "peak_mb": round(peak / 2**20, 1),
          "payload_received": exchange.bucket(n * max(len(b) for b in blobs))}


class _FullSharding:
  def __init__(self, layout: Layout, devices: list[FakeDevice], axis: int | None):
    self.layout, self.devices, self.axis = layout, devices, axis

  def devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
    k = shape[self.axis] // len(self.devices) if self.axis is not None else 0
    return {d: tuple(slice(i * k, (i + 1) * k) if a == self.axis else slice(None)
                     for a in range(len(shape))) for i, d in enumerate(self.devices)}


# ------------------------------------------------------------------ driver
def fit(points: dict[int, float], lo: int, hi: int) -> float | None:
  pts = [(math.log(n), math.log(v)) for n, v in points.items() if lo <= n <= hi and v > 0]
  if len(pts) < 2:
    return None
  mx = sum(p[0] for p in pts) / len(pts)
  my = sum(p[1] for p in pts) / len(pts)
  return round(sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts), 3)


def main(argv: Sequence[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", type=int, nargs="*", default=[8, 64, 256, 1024, 4096, 16384])
  ap.add_argument("--cases", nargs="*", default=["none", "one", "two"])
  ap.add_argument("--redundancy", nargs="*", default=["replicas", "parity"])
  ap.add_argument("--before", type=int, default=0,
                  help="also time the full exchange up to this many hosts")
  ap.add_argument("--out", type=Path)
  ap.add_argument("--plot", type=Path)
  args = ap.parse_args(argv)
  rows = []
  for red in args.redundancy:
    for case in args.cases:
      for n in args.sizes:
        rows.append(run_case(n, case, red))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "state_received"}),
              file=sys.stderr, flush=True)
  befores = [before(n) for n in args.sizes if n <= args.before]
  growth = {}
  for red in args.redundancy:
    for case in args.cases:
      mine = [r for r in rows if r["redundancy"] == red and r["case"] == case]
      growth[f"{red}/{case}"] = {
          "cpu": fit({r["n"]: r["cpu_s_max"] for r in mine}, 1024, 16384),
          "memory": fit({r["n"]: r["peak_mb_all_hosts_run"] for r in mine}, 1024, 16384),
          "payload": fit({r["n"]: r["payload_received_max"] for r in mine}, 1024, 16384)}
  ratios = {}
  for b in befores:
    now = next((r for r in rows if r["n"] == b["n"] and r["case"] == "one"
                and r["redundancy"] == "replicas"), None)
    if now is not None:
      ratios[b["n"]] = {"cpu_before_over_after": round(b["cpu_s"] / max(now["cpu_s_max"], 1e-9), 1),
                        "payload_before_over_after": round(
                            b["payload_received"] / max(now["payload_received_max"], 1), 1)}
  result = {"rows": rows, "before": befores, "before_over_after": ratios,
            "growth_exponent_1024_16384": growth}
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    args.out.write_text(text)
  if args.plot:
    _plot(result, args.plot)
  return result


def _plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for key in sorted({(r["redundancy"], r["case"]) for r in result["rows"]}):
    mine = [r for r in result["rows"] if (r["redundancy"], r["case"]) == key]
    ns = [r["n"] for r in mine]
    a.loglog(ns, [r["cpu_s_max"] for r in mine], "o-", label="/".join(key))
    b.loglog(ns, [r["payload_received_max"] for r in mine], "o-", label="/".join(key))
  if result["before"]:
    ns = [x["n"] for x in result["before"]]
    a.loglog(ns, [x["cpu_s"] for x in result["before"]], "k--", label="full exchange")
    b.loglog(ns, [x["payload_received"] for x in result["before"]], "k--",
             label="full exchange")
  a.set(xlabel="hosts", ylabel="CPU s a host (decision + plan)")
  b.set(xlabel="hosts", ylabel="collective bytes a host receives")
  a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
