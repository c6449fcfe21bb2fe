"""Shared benchmark plumbing: CPU device setup, memcpy baseline, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def setup_cpu_devices(n: int = 8) -> None:
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
  """The fastest of ``repeats`` calls of ``fn``, each until its JAX result is ready."""
  import jax
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


class FullCollections:
  """Counts Python's full (generation 2) garbage collections, and their
  seconds, while the block runs (``gc.callbacks``): per-piece objects that
  outlive young collections make them run often, on whichever thread is
  allocating, often the training loop's."""

  def __init__(self) -> None:
    self.count = 0
    self.seconds = 0.0
    self._start = 0.0

  def _callback(self, phase: str, info: dict[str, Any]) -> None:
    if info.get("generation") != 2:
      return
    if phase == "start":
      self._start = time.perf_counter()
    else:
      self.count += 1
      self.seconds += time.perf_counter() - self._start

  def __enter__(self) -> FullCollections:
    import gc
    gc.callbacks.append(self._callback)
    return self

  def __exit__(self, *exc: object) -> None:
    import gc
    gc.callbacks.remove(self._callback)


def upper_median(xs: Sequence[float]) -> float:
  """The middle value (the upper one of an even count)."""
  return sorted(xs)[len(xs) // 2]


class Memcpy:
  """Single-thread ``np.copyto`` of ``nbytes`` into a touched, reused
  buffer, timed one sample at a time (each can be taken beside the
  operation it is compared with: this machine's bandwidth drifts)."""

  def __init__(self, nbytes: int) -> None:
    self.src = np.ones(nbytes, np.uint8)
    self.dst = np.zeros(nbytes, np.uint8)
    np.copyto(self.dst, self.src)
    self.samples: list[float] = []

  def sample(self) -> None:
    t = time.perf_counter()
    np.copyto(self.dst, self.src)
    self.samples.append(time.perf_counter() - t)

  def median_since(self, start: int) -> float:
    """Median seconds of the samples from number ``start`` on."""
    return upper_median(self.samples[start:])


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
  """Single-thread np.copyto bandwidth (bytes/s) into a touched, reused buffer."""
  m = Memcpy(nbytes)
  for _ in range(repeats):
    m.sample()
  return nbytes / m.median_since(0)


def checked_copy_seconds(sources: Sequence[np.ndarray], copies: int, repeats: int = 5,
                         threads: int = 2) -> float:
  """Median seconds to write ``copies`` checked copies of ``sources`` (flat
  uint8 arrays) with snapstore's own fused copy and crc32c
  (``_checksum.copy_crc``: every copy written from the same loads) on
  ``threads`` threads, into touched, reused buffers, and nothing else: the
  least a store that checks every byte and keeps that many copies pays here."""
  from concurrent import futures

  from snapstore._checksum import copy_crc
  dsts = [[np.zeros_like(s) for s in sources] for _ in range(copies)]
  jobs = [(s, [d[j] for d in dsts]) for j, s in enumerate(sources)]
  if len(jobs) < threads:  # few big sources: each split between the threads
    jobs = [(s[a:a + step], [d[a:a + step] for d in ds]) for s, ds in jobs
            for step in [-(-len(s) // threads)] for a in range(0, len(s), step)]
  share = [jobs[i::threads] for i in range(threads)]

  def work(mine: list[tuple[np.ndarray, list[np.ndarray]]]) -> None:
    for src, (first, *more) in mine:
      copy_crc(first, src, 0, more)
  with futures.ThreadPoolExecutor(threads) as pool:
    run = lambda: list(pool.map(work, share))  # noqa: E731
    run()
    return median_seconds(run, repeats)


def checked_floor(state: Any, repeats: int, memcpy: Memcpy) -> dict[str, float | int]:
  """One checked copy of every addressable shard of ``state``
  (:func:`checked_copy_seconds`, on one thread and on two): ``seconds``,
  the faster; ``threads``, which; ``vs_memcpy``, the median of ``memcpy``
  samples taken beside the timed runs over ``seconds``."""
  import jax
  sources = [np.asarray(s.data).reshape(-1).view(np.uint8)
             for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
             for s in x.addressable_shards]
  start = len(memcpy.samples)
  times = {}
  for threads in (1, 2):
    memcpy.sample()
    times[threads] = checked_copy_seconds(sources, copies=1, repeats=repeats, threads=threads)
    memcpy.sample()
  threads = min(times, key=times.__getitem__)
  return {"seconds": times[threads], "threads": threads,
          "vs_memcpy": memcpy.median_since(start) / times[threads]}


def piecewise_floor(state: Any, repeats: int = 5) -> dict[str, float]:
  """Median seconds of the least a store written in Python pays per piece,
  unchecked, in this process: ``save_s``, a numpy view of every addressable
  shard (what pins it against donation) copied into reused memory, one
  ``np.copyto`` a piece; ``restore_s``, every piece copied back out into
  reused memory and each leaf placed with JAX's batched put (snapstore's
  ``_build.place_host``, what a restore ends in). The copies run on one
  thread or split between two, whichever is faster (two win for big pieces;
  for small ones they only contend for the GIL). No checksums, manifests or
  second copies: with many small pieces what is left is per-piece Python
  and JAX's per-shard cost."""
  from concurrent import futures

  import jax

  from snapstore._arena import host_arena
  from snapstore._build import place_host, wanted_shards
  from snapstore._index import align, nbytes as index_nbytes, shape_of
  from snapstore._tree import leaf_spec, positions
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  specs = [leaf_spec(f"w{i}", x) for i, x in enumerate(leaves)]
  rows = []  # (leaf, device, index, position, offset, bytes) of each wanted shard
  at = 0
  for j, x in enumerate(leaves):
    where = positions(x)
    for device, index in wanted_shards(x.sharding, tuple(x.shape)):
      n = index_nbytes(index, x.dtype.itemsize)
      rows.append((j, device, index, where[device.id], at, n))
      at += align(n)  # page-aligned parts: the placed arrays adopt them, as a restore's do
  slot = np.zeros(at, np.uint8)
  arena = host_arena(at)
  halves = [rows[:len(rows) // 2], rows[len(rows) // 2:]]

  def save_some(some: Sequence[tuple[Any, ...]]) -> None:
    for j, _, _, pos, off, n in some:
      view = np.asarray(leaves[j].addressable_data(pos)).reshape(-1).view(np.uint8)
      np.copyto(slot[off:off + n], view)

  def restore_some(some: Sequence[tuple[Any, ...]]) -> list[np.ndarray]:
    out = []
    for j, _, index, _, off, n in some:
      part = arena[off:off + n]
      np.copyto(part, slot[off:off + n])
      out.append(part.view(leaves[j].dtype).reshape(shape_of(index)))
    return out

  def place(parts: Sequence[np.ndarray]) -> None:
    by_leaf: list[list[int]] = [[] for _ in leaves]
    for k, (j, *_) in enumerate(rows):
      by_leaf[j].append(k)
    jax.block_until_ready([
        place_host(spec, x.sharding, [rows[k][1:3] for k in ks], [parts[k] for k in ks])
        for x, spec, ks in zip(leaves, specs, by_leaf, strict=True)])

  with futures.ThreadPoolExecutor(2) as pool:
    two = lambda fn: [y for part in pool.map(fn, halves) for y in (part or [])]  # noqa: E731
    save_one = lambda: save_some(rows)  # noqa: E731
    save_two = lambda: two(save_some)  # noqa: E731
    restore_one = lambda: place(restore_some(rows))  # noqa: E731
    restore_two = lambda: place(two(restore_some))  # noqa: E731
    for fn in (save_one, save_two, restore_one, restore_two):
      fn()
    return {"save_s": min(median_seconds(save_one, repeats), median_seconds(save_two, repeats)),
            "restore_s": min(median_seconds(restore_one, repeats),
                             median_seconds(restore_two, repeats))}


def jax_floor(state: Any, repeats: int = 5) -> dict[str, float]:
  """Median seconds of JAX's own per-shard cost in this process, nothing
  else: ``hold_s``, a numpy view of every addressable shard (the hold that
  keeps XLA from donating a buffer while a save reads it; on CPU a view
  costs what a copy of a small shard does); ``place_s``, every leaf placed
  from host buffers already filled (JAX's batched put, zero-copy on CPU:
  what a restore must end in). Any store that checks the bytes it saves and
  restores pays these plus its copies, so the few-leaves time plus the
  difference of these floors bounds the many-leaves time from below."""
  import jax

  from snapstore._arena import host_arena
  from snapstore._build import place_host, wanted_shards
  from snapstore._index import align, nbytes as index_nbytes, shape_of
  from snapstore._tree import leaf_spec
  leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  specs = [leaf_spec(f"w{i}", x) for i, x in enumerate(leaves)]
  shards = [s.data for x in leaves for s in x.addressable_shards]
  wanted = [wanted_shards(x.sharding, tuple(x.shape)) for x in leaves]
  total = sum(align(index_nbytes(i, x.dtype.itemsize)) for x, w in zip(leaves, wanted, strict=True)
              for _, i in w)
  arena, at, parts = host_arena(total), 0, []
  for x, w in zip(leaves, wanted, strict=True):
    parts.append([])
    for _, index in w:
      n = index_nbytes(index, x.dtype.itemsize)
      parts[-1].append(arena[at:at + n].view(x.dtype).reshape(shape_of(index)))
      at += align(n)
  arena[:] = 1  # touched, as a restore's copies leave it

  def place() -> None:
    jax.block_until_ready([place_host(spec, x.sharding, w, p)
                           for x, spec, w, p in zip(leaves, specs, wanted, parts, strict=True)])

  hold = lambda: list(map(np.asarray, shards))  # noqa: E731
  hold()
  place()
  return {"hold_s": median_seconds(hold, repeats), "place_s": median_seconds(place, repeats)}


def ram_dir(prefix: str) -> Path:
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def emit(name: str, result: dict[str, Any], out: str | None) -> None:
  text = json.dumps({"benchmark": name, **result}, indent=2)
  print(text)
  if out:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


def sized_main(name: str, doc: str | None, run: Callable[[int, int], dict[str, Any]],
               argv: Sequence[str] | None, *, devices: int = 8) -> int:
  """The ``main`` of a benchmark that takes ``--mb``, ``--repeats`` and
  ``--out`` and runs ``run(mb, repeats)`` on ``devices`` CPU devices."""
  p = argparse.ArgumentParser(prog=f"benchmarks.{name}", description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=f"bench-results/{name}.json")
  args = p.parse_args(argv)
  setup_cpu_devices(devices)
  emit(name, run(args.mb, args.repeats), args.out)
  return 0


def job_args(p: argparse.ArgumentParser, *, steps: int, rounds: int, repeats: int) -> None:
  """The options of a benchmark that runs ``_mh_worker.Job`` on 4 hosts."""
  p.add_argument("--mb", type=int, default=256)
  p.add_argument("--steps", type=int, default=steps)
  p.add_argument("--rounds", type=int, default=rounds)
  p.add_argument("--repeats", type=int, default=repeats)
  p.add_argument("--step-s", type=float, default=0.5,
                 help="step time: the state update, padded with a sleep that stands "
                      "for accelerator compute (host cores free); 0: the bare update")


def run_workers(module: str, argv: Callable[[Path], Sequence[str]], *, prefix: str,
                run_id: str, env: dict[str, str] | None = None) -> dict[str, Any]:
  """Runs ``module`` on 4 local hosts (2 CPU devices each) under ``snapstore
  launch`` with ``argv(work) + --out --store`` in a fresh RAM-disk folder;
  returns the JSON host 0 wrote (the hosts' log tails in the error if not)."""
  from snapstore.testing import launch
  work = ram_dir(prefix)
  root = str(Path(__file__).resolve().parents[1])
  env = dict(env or {}, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  out = work / "result.json"
  try:
    launch(module, [*argv(work), "--out", str(out), "--store", str(work / "store")],
           num_hosts=4, devices_per_host=2, store_dir=work / "store", run_id=run_id,
           max_incarnations=1, timeout_s=1200, log_dir=work, env=env)
    return json.loads(out.read_text())
  except RuntimeError as e:
    logs = "".join(p.read_text()[-2000:] for p in sorted(work.glob("inc0-host*.log")))
    raise RuntimeError(f"{e}\n{logs}") from e
  finally:
    cleanup(work)


def cleanup(path: Path) -> None:
  shutil.rmtree(path, ignore_errors=True)


def make_state(nbytes: int, leaves: int | None = None):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = NamedSharding(mesh, P(("data", "model")))
  if leaves:  # the same bytes over ``leaves`` leaves (per-leaf costs show)
    leaf_elems = max(8, nbytes // 4 // leaves // 8 * 8)
    n = leaves
  else:
    leaf_elems = min(4 << 20, nbytes // 4)
    n = max(1, nbytes // (leaf_elems * 4))
  make = jax.jit(lambda k: jax.random.normal(k, (leaf_elems,), jnp.float32),
                 out_shardings=sharding)
  return {f"w{i}": make(jax.random.key(i)) for i in range(n)}, sharding


def calibrated_step(state: Any, sharding: Any, seconds: float) -> tuple[Any, Any, int]:
  """A jitted, donating step ``fn(state, x, iters) -> (state, y)`` whose
  compute (a tanh-matmul chain) takes about ``seconds``; touches every leaf."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  w = jax.device_put(jnp.eye(512, dtype=jnp.float32) * 0.999, NamedSharding(sharding.mesh, P()))
  x = jax.device_put(jnp.ones((1024, 512), jnp.float32), NamedSharding(sharding.mesh, P("data")))

  def body(state, x, iters):
    y = jax.lax.fori_loop(0, iters, lambda _, y: jnp.tanh(y @ w), x)
    return jax.tree.map(lambda a: a + y[0, 0] * 0, state), y
  fn = jax.jit(body, static_argnums=2, donate_argnums=0)
  state = jax.tree.map(lambda a: a.copy(), state)  # the caller's state stays intact
  iters = 1
  while True:
    state, _ = fn(state, x, iters)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state, _ = fn(state, x, iters)
    jax.block_until_ready(state)
    if time.perf_counter() - t >= seconds or iters > 1 << 16:
      return fn, x, iters
    iters *= 2


def demo_job(work: Path, name: str, steps: int, worker_args: Sequence[str], *,
             num_hosts: int, kills: Sequence[Any] = (), timeout_s: float = 600,
             env: dict[str, str] | None = None, in_place: bool = False,
             max_replacements: int = 8) -> tuple[list[Any], Path]:
  """Runs the demo's worker (``snapstore.demo.worker``) as a job named
  ``name`` under ``snapstore launch`` in ``work``: its store in
  ``work/store-<name>``, its reports and logs in ``work/<name>``, one
  incarnation more than there are kills. Returns (incarnations, report dir)."""
  from snapstore.testing import launch
  out, store = work / name, work / f"store-{name}"
  out.mkdir()
  incs = launch("snapstore.demo.worker",
                ["--steps", str(steps), "--out", str(out), "--store", str(store),
                 "--run-id", name, *worker_args],
                num_hosts=num_hosts, devices_per_host=2, store_dir=store, run_id=name,
                kills=kills, max_incarnations=len(kills) + 1, timeout_s=timeout_s,
                log_dir=out, env=env, in_place=in_place, max_replacements=max_replacements)
  return incs, out


def step_intervals(report: dict[str, Any], skip: int = 3) -> list[float]:
  """Seconds between consecutive steps of one worker report, past the first
  ``skip`` (compilation)."""
  times = [report["times"][k] for k in sorted(report["times"], key=int)]
  # consecutive pairs: the second list is one shorter
  return [b - a for a, b in zip(times[skip:], times[skip + 1:], strict=False)]
