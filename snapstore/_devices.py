"""The devices of a multi-controller job, in the one order every process uses.

Every collective snapstore runs (manifest exchange, replica transfer, restore
exchange) builds its mesh from :func:`devices`. By default that is every
device sorted by (process, id). After an in-place recovery
(:mod:`snapstore.recovery`) it is a new order that all processes derive from
the same (device, process incarnation) pairs, on CPU only
(:func:`rekey_needed`; GPU and TPU keep JAX's order): gloo keys its communicators
(and their rendezvous keys in the coordination service) by the ordered list
of a collective's devices only, so a process that rejoined with the same id
would otherwise meet the dead process's communicator and fail forever, and
a survivors' communicator that failed mid-operation (or whose connections
the failure shut, :mod:`snapstore.recovery.watchdog`) would meet leftover bytes. The new order
is drawn so that every group along one axis of a mesh reshaped from it (up
to 3 axes), and the whole order, is new (:func:`rekeyed`); with 8 devices
that leaves two such orders after the first, then a full restart. Groups it
does not check (over two axes at once, transposed meshes) may meet an old
communicator: the step then keeps failing and
:class:`snapstore.recovery.RestartRequired` ends in a full restart, never in
a wrong state.

The job's membership (:func:`membership`, :func:`processes`) and the
``InPlace.live()`` block this process is in (:func:`failed_in_block`) are
kept here too, set by :mod:`snapstore.recovery.in_place` and read by the
Orbax tier and its barrier, which need not import in-place recovery.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

_order: tuple[jax.Device, ...] | None = None


def devices() -> list[jax.Device]:
  """Every device of the job, in the order all processes agree on."""
  if _order is not None:
    return list(_order)
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def set_devices(order: Sequence[jax.Device] | None) -> None:
  """Sets the agreed order (None: back to the default)."""
  global _order
  _order = None if order is None else tuple(order)


_membership: str | None = None
_processes: tuple[int, ...] | None = None


def membership() -> str | None:
  """A name of the job's current members (each process and its incarnation),
  the same on every process; None until ``InPlace.live()`` first sets it."""
  return _membership


def processes() -> tuple[int, ...] | None:
  """The current members' process indices, ascending, while the job runs
  without some of its processes (``InPlace`` with ``min_hosts``); None
  while every process is a member."""
  return _processes


def set_membership(name: str | None, members: tuple[int, ...] | None = None) -> None:
  """Sets the name and, when not every process is one, the members."""
  global _membership, _processes
  _membership, _processes = name, members


_block_failure: str | None = None  # the failure key of the live() block this process is in


def set_block_failure(key: str | None) -> None:
  """Sets the failure key of the ``InPlace.live()`` block this process is
  in (None: outside every block)."""
  global _block_failure
  _block_failure = key


def failed_in_block(client: Any) -> str | None:
  """The process whose step failed in the ``live()`` block this process is
  in (it wrote the block's failure key to ``client``, the coordination
  service), or None: for a wait inside the block that is no collective (an
  Orbax barrier), which that process will never reach."""
  key = _block_failure
  if key is None:
    return None
  try:
    return str(client.key_value_try_get(key))
  except Exception:  # noqa: BLE001  (NOT_FOUND: none failed)
    return None


def rekey_needed(platform: str) -> bool:
  """True where a membership change needs a new device order: CPU, whose
  gloo communicators are keyed by the ordered device list alone. NCCL's are
  keyed by the processes' incarnations (JAX's fault-tolerance doc), and a
  drawn order would scatter a topology-aware mesh and cap the heals a job
  can take, so GPU and TPU keep JAX's order."""
  return platform == "cpu"


def cliques(order: Sequence[int], max_dims: int = 3) -> set[tuple[int, ...]]:
  """Every ordered device group a collective can use on a mesh made by
  reshaping ``order`` (device ids) to any shape of up to ``max_dims`` axes."""
  out: set[tuple[int, ...]] = {tuple(order)}
  arr = np.asarray(order)
  for shape in _shapes(len(order), max_dims):
    grid = arr.reshape(shape)
    for axis, size in enumerate(shape):
      out.update(map(tuple, np.moveaxis(grid, axis, -1).reshape(-1, size).tolist()))
  return out


def _shapes(n: int, max_dims: int) -> list[tuple[int, ...]]:
  if n == 1 or max_dims == 0:
    return [()] if n == 1 else []
  return [(f, *rest) for f in range(2, n + 1) if n % f == 0
          for rest in _shapes(n // f, max_dims - 1)]


MAX_DRAWS = 200_000
EXHAUSTIVE = 8  # up to this many devices, every order is tried (8! = 40,320)
LOOKAHEAD = 16  # orders that fit, compared for the room each leaves
SAMPLE = 1024  # fitting orders among which that room is counted (then the search stops)
BATCH = 1024  # orders checked at a time


@functools.lru_cache(maxsize=16)
def _positions(n: int, max_dims: int = 3) -> tuple[np.ndarray, ...]:
  """The groups of :func:`cliques` as positions in an order of ``n``
  devices: one array (groups, k) per group size k."""
  by_size: dict[int, list[tuple[int, ...]]] = {}
  for c in cliques(list(range(n)), max_dims):
    by_size.setdefault(len(c), []).append(c)
  return tuple(np.array(sorted(g), dtype=np.intp) for _, g in sorted(by_size.items()))


def _hash(groups: np.ndarray, n: int) -> np.ndarray:
  """One number per group (rows of ranks below ``n``, the last axis): equal
  groups get equal numbers. Exact while (n+1)**(k+1) < 2**64; beyond, a
  wrapping hash whose rare collisions only rule out an order that would
  have fitted, never let one through that does not."""
  base = np.uint64(n + 1)
  h = np.full(groups.shape[:-1], groups.shape[-1], dtype=np.uint64)
  with np.errstate(over="ignore"):
    for j in range(groups.shape[-1]):
      h = h * base + groups[..., j].astype(np.uint64) + np.uint64(1)
  return h


def _codes(orders: np.ndarray, n: int, new: np.ndarray) -> np.ndarray:
  """(orders, groups): the number of each group of each order (rows of
  ranks); 0 for a group without a ``new`` rank (those never clash)."""
  out = []
  for pos in _positions(n):
    sub = orders[:, pos]
    h = _hash(sub, n)
    h[~new[sub].any(axis=-1)] = 0
    out.append(h)
  return np.concatenate(out, axis=1)


@functools.lru_cache(maxsize=2)
def _every_order(n: int) -> np.ndarray:
  return np.array(list(itertools.permutations(range(n))), dtype=np.intp)


def rekeyed(live: Mapping[jax.Device, int], used: set[tuple[int, ...]],
            new: set[int]) -> list[jax.Device] | None:
  """An order of the devices of ``live`` (device -> its process's
  incarnation, as ``live_devices`` reports it to every process alike) in
  which no device group (:func:`cliques`) that holds a ``new`` device (a
  replacement's) was ``used`` before: gloo would find the dead process's
  communicator (survivors) or its rendezvous keys (the replacement) under
  such a group and fail forever.

  Of the orders that fit, the one that leaves the most room for the next
  heal is taken (of the first :data:`LOOKAHEAD` that fit, the one that the
  most others still fit beside). Taking the first that fitted left no order
  for a second heal about one time in a hundred with 8 devices. Up to
  :data:`EXHAUSTIVE` devices every order is tried, beyond that
  :data:`MAX_DRAWS` random ones, until :data:`SAMPLE` fit; they are tried
  in an order drawn from a generator seeded by ``live``, so every process
  chooses the same. None if none fits (then only a full restart clears the
  old keys)."""
  key = repr(sorted((d.id, int(inc)) for d, inc in live.items())).encode()
  rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
  ordered = sorted(live, key=lambda d: d.id)
  n = len(ordered)
  rank = {d.id: r for r, d in enumerate(ordered)}
  every = _every_order(n)[rng.permutation(math.factorial(n))] if n <= EXHAUSTIVE else None
  total = len(every) if every is not None else MAX_DRAWS
  is_new = np.array([d.id in new for d in ordered])
  stale = {int(_hash(np.array([rank[i] for i in c]), n)) for c in used
           if all(i in rank for i in c) and any(i in new for i in c)}
  stale_codes = np.array(sorted(stale - {0}), dtype=np.uint64)
  fit_orders, fit_codes, fits = [], [], 0
  for lo in range(0, total, BATCH):  # bounded memory: a batch, and SAMPLE fits
    batch = (every[lo:lo + BATCH] if every is not None else
             rng.permuted(np.tile(np.arange(n), (min(BATCH, total - lo), 1)), axis=1))
    codes = _codes(batch, n, is_new)
    ok = ~np.isin(codes, stale_codes).any(axis=1)
    fit_orders.append(batch[ok])
    fit_codes.append(codes[ok])
    fits += int(ok.sum())
    if fits >= SAMPLE or (fits >= LOOKAHEAD and lo + BATCH >= MAX_DRAWS // 10):
      break  # enough to choose from (rare fits: many devices)
  found = np.concatenate(fit_orders)
  if not len(found):
    return None
  codes = np.concatenate(fit_codes)[:SAMPLE]  # the room is counted among these
  room = [int((~np.isin(codes, np.setdiff1d(c, [0])).any(axis=1)).sum())
          for c in codes[:LOOKAHEAD]]
  return [ordered[r] for r in found[int(np.argmax(room))]]
