"""Capacity: the host RAM each redundancy option needs, before a run.

A host keeps, per snapshot, its own pieces plus what it holds for other
failure domains: ``replicas`` full copies of the pieces that have no
data-parallel twin in another domain, or with :class:`Parity` one block of ``1 / k``
of them. A store holds ``keep + 1`` snapshots at once (the newest ``keep``
and the one being written). :func:`from_state` reads the pieces from a
state's shardings (every host's, from any process); :func:`from_size` takes
the sizes (``snapstore capacity`` on the command line).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from ._index import align, nbytes as index_nbytes, normalize
from ._placement import host_domains
from .options import Parity, Redundancy, Replicas

__all__ = ["DEFAULT_OPTIONS", "HostBytes", "from_size", "from_state", "label", "staging_hbm"]


def label(option: Redundancy) -> str:
  """``"replicas=N"`` or ``"parity k=K"``: a plan's name."""
  return (f"parity k={option.k}" if isinstance(option, Parity)
          else f"replicas={option.copies}")


def _extra(option: Redundancy, unprotected: int) -> int:
  if isinstance(option, Parity):
    return math.ceil(unprotected / option.k)
  return option.copies * unprotected


def _fits(option: Redundancy, domains: int) -> bool:
  """Whether ``option`` can protect anything with ``domains`` domains."""
  if isinstance(option, Parity):
    return domains >= option.k + 1 and domains % (option.k + 1) == 0
  return option.copies < domains or option.copies == 0


DEFAULT_OPTIONS: tuple[Redundancy, ...] = (
    Replicas(0), Replicas(1), Replicas(2), Parity(1), Parity(3), Parity(7))


@dataclasses.dataclass(frozen=True)
class HostBytes:
  """One option's bytes on the busiest host."""

  option: str
  own: int        # bytes of its own pieces, per snapshot
  extra: int      # bytes kept for other domains, per snapshot
  snapshots: int  # held at once: keep + 1
  possible: bool  # False: the domains do not allow this option

  @property
  def total(self) -> int:
    return self.snapshots * (self.own + self.extra)

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "total": self.total}


def staging_hbm(own: int, devices_per_host: int, budget_bytes: int | None = None) -> int:
  """Device memory (HBM) per device that a save stages on an accelerator
  (``SnapshotOptions.staging``): a device's share of its host's own bytes
  per snapshot, at most ``budget_bytes`` (``staging_budget_bytes``; what
  does not fit is copied to host before ``save`` returns, at the link's
  speed). The default budget is the device's free memory at its peak."""
  if devices_per_host < 1:
    raise ValueError(f"devices_per_host must be >= 1, got {devices_per_host}")
  share = math.ceil(own / devices_per_host)
  return share if budget_bytes is None else min(share, budget_bytes)


def _host_bytes(own: int, unprotected: int, *, keep: int, domains: int,
           options: Sequence[Redundancy]) -> list[HostBytes]:
  return [HostBytes(label(o), own, _extra(o, unprotected) if _fits(o, domains) else 0,
                   keep + 1, _fits(o, domains)) for o in options]


def from_size(state_bytes: int, *, hosts: int, hosts_per_domain: int = 1,
              data_parallel: int = 1, keep: int = 2,
              options: Sequence[Redundancy] = DEFAULT_OPTIONS) -> list[HostBytes]:
  """A state of ``state_bytes`` sharded evenly over ``hosts``, held
  ``data_parallel`` times (each copy in other domains: its pieces need no
  extra bytes when ``data_parallel > 1``)."""
  if hosts < 1 or hosts % (hosts_per_domain * data_parallel):
    raise ValueError(f"{hosts} hosts do not split into {data_parallel} data-parallel copies "
                     f"of domains of {hosts_per_domain}")
  own = math.ceil(state_bytes * data_parallel / hosts)
  return _host_bytes(own, own if data_parallel == 1 else 0, keep=keep,
                domains=hosts // hosts_per_domain, options=options)


def from_state(state: Any, *, hosts_per_domain: int | None = None, keep: int = 2,
               options: Sequence[Redundancy] = DEFAULT_OPTIONS) -> list[HostBytes]:
  """From the shardings of ``state`` (arrays or ``ShapeDtypeStruct`` with
  shardings; leaves without one are ignored): the busiest host's bytes per
  option. Each distinct piece a host holds counts once, in whole pages as a
  store keeps it; a piece held by one failure domain only counts as
  unprotected at its lowest holder."""
  devices = jax.devices()
  domains = host_domains(devices, hosts_per_domain)
  own: dict[int, int] = collections.Counter()
  unprotected: dict[int, int] = collections.Counter()
  for leaf in jax.tree.leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
      continue
    shape = tuple(leaf.shape)
    itemsize = jax.numpy.dtype(leaf.dtype).itemsize
    holders: dict[Any, set[int]] = collections.defaultdict(set)
    for device, idx in sharding.devices_indices_map(shape).items():
      holders[normalize(idx, shape)].add(device.process_index)
    for idx, hosts in holders.items():
      n = align(index_nbytes(idx, itemsize))
      for h in hosts:
        own[h] += n
      if len({domains[h] for h in hosts}) == 1:
        unprotected[min(hosts)] += n
  busiest = max(own, key=lambda h: own[h] + unprotected[h], default=0)
  return _host_bytes(own.get(busiest, 0), unprotected.get(busiest, 0), keep=keep,
                domains=len(set(domains.values())), options=options)
