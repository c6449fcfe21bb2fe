"""A multi-host restore whose metadata is what each host needs, not the job's.

For one candidate step (:mod:`snapstore._multihost.agree`), in three collectives whose size is
set by the pieces that must move, never by the host count times an
inventory:

1. **needs**: each host lists the target regions of its own devices that its
   own store cannot give it (none, in the usual restore; every region, for
   a replacement that lost its store), and whether it lacks the step's
   header (leaves, scalars, ``extra``);
2. **holders**: for each need, every host that holds an exact, not-bad copy
   puts its distance after the needer in process order into one element-wise
   minimum; the nearest holder sends it. A host that holds only an
   overlapping copy (the target cut differently from the save) marks that
   instead;
3. **rows**: each chosen holder publishes the size and checksums of what it
   sends (from its own manifest), and the lowest holder of the step its
   header where some host lacks it.

Every host derives the same verdict from the same bytes: the step is
restorable here (:class:`Planned`), or no copy of some needed piece
survives (:class:`Lost`: an older step, or the persistent tier), or the
pieces cannot be matched by region (a changed target layout:
:class:`Fallback`, the full inventory exchange of :mod:`snapstore._multihost.exchange`,
reported as such). A need no host holds in a step with parity is rebuilt
from its stripes' survivors only (:mod:`snapstore._multihost.rebuild`). The moves themselves
are :mod:`snapstore._multihost.moves`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .. import errors
from .._build import wanted_shards
from .._checksum import ChecksumKind
from .._index import Index, full, nbytes as index_nbytes
from .._manifest import Manifest, PieceRecord, PieceTable
from .._planner import REBUILT, CopyKey, shared_content
from .._tree import LeafKind, LeafSpec, check_compatible, spec_from_row, target_sharding
from . import rebuild
from .agree import Candidate, digest_of
from .collective import NONE, Collective, gather_blobs

#: The most bytes one point-to-point transfer carries (more: several rounds).
BATCH_BYTES = 64 << 20


class Need(NamedTuple):
  """Host ``needer`` lacks region ``region`` of target leaf ``pos`` (its
  position in the flattened abstract state). (A named tuple: a replacement
  has thousands.)"""

  needer: int
  pos: int
  region: Index
  own_bad: bool = False  # the needer holds it, but its copy failed its check


@dataclasses.dataclass(frozen=True)
class Header:
  """What the hosts of one step agree on, as a host without it receives it."""

  leaves: tuple[LeafSpec, ...]
  scalars: dict[int, Any]
  extra: Any
  chunk_bytes: int
  tree_digest: str
  num_hosts: int

  @staticmethod
  def of(m: Manifest) -> Header:
    return Header(tuple(m.leaves), dict(m.scalars), m.extra, m.chunk_bytes, m.tree_digest,
                  m.num_hosts)


@dataclasses.dataclass(frozen=True)
class Incoming:
  """One piece this host receives: from ``holder``, its record (the
  holder's size and checksums; the region is its index)."""

  need: int
  holder: int
  record: PieceRecord


@dataclasses.dataclass(frozen=True)
class Planned:
  """The step restores with these moves; the same on every host."""

  candidate: Candidate
  header: Header
  needs: tuple[Need, ...]
  holder: tuple[int, ...]           # per need (REBUILT: from parity)
  nbytes: tuple[int, ...]           # per need
  incoming: tuple[Incoming, ...]    # this host's
  outgoing: tuple[int, ...]         # the needs this host sends
  stripes: tuple[rebuild.Stripe, ...] = ()  # the parity rebuilds


@dataclasses.dataclass(frozen=True)
class Lost:
  why: str


@dataclasses.dataclass(frozen=True)
class Fallback:
  why: str


# ------------------------------------------------------------------ needs
def target_regions(spec: LeafSpec, target: Any) -> list[Index]:
  """The distinct regions of a target leaf this process's devices hold (the
  whole leaf for a host array; none for a scalar)."""
  if spec.kind is LeafKind.SCALAR:
    return []
  if spec.kind is LeafKind.NUMPY or getattr(target, "sharding", None) is None:
    return [full(spec.shape)]
  return list(dict.fromkeys(idx for _, idx in wanted_shards(target_sharding(target),
                                                      tuple(spec.shape))))


class Held:
  """One host's copies at one step: its manifest's rows by (leaf, region),
  and each leaf's regions as arrays of bounds (for overlap tests)."""

  def __init__(self, host: int, manifest: Manifest | None, bad: Collection[CopyKey]):
    self.host = host
    self.manifest = manifest
    self.exact: dict[tuple[int, Index], tuple[Any, ...]] = {}
    self.by_path: dict[str, int] = {}
    self._regions: dict[int, list[Index]] = {}
    self._bounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self.bad: set[tuple[int, Index]] = set()  # its own copies found bad
    if manifest is None:
      return
    step = manifest.step
    self.by_path = {s.path: i for i, s in enumerate(manifest.leaves)}
    for row in manifest.pieces.rows:  # (rows: no record object made per piece)
      key = (row[0], row[1])
      if bad and (host, step, *key) in bad:
        self.bad.add(key)
        continue
      if key in self.exact:
        continue
      self.exact[key] = row
      self._regions.setdefault(row[0], []).append(row[1])

  def leaf_of(self, spec: LeafSpec) -> int | None:
    return self.by_path.get(spec.path)

  def record(self, leaf: int, region: Index) -> PieceRecord:
    return PieceTable.record(self.exact[(leaf, region)])

  def overlapping(self, leaf: int, regions: Sequence[Index]) -> np.ndarray:
    """For each of ``regions`` (of ``leaf``), whether some copy here
    overlaps it: one vectorized test a leaf, not one a region."""
    bounds = self._bounds.get(leaf)
    if bounds is None:
      pieces = self._regions.get(leaf)
      if not pieces:
        return np.zeros(len(regions), bool)
      arr = np.array(pieces, np.int64)  # (pieces, dims, 2)
      bounds = self._bounds[leaf] = (arr[..., 0], arr[..., 1])
    lo, hi = bounds
    if not lo.shape[1]:  # 0-d leaves: every piece is the whole leaf
      return np.ones(len(regions), bool)
    r = np.array(regions, np.int64)  # (regions, dims, 2)
    return ((lo[None] < r[:, None, :, 1]) & (r[:, None, :, 0] < hi[None])).all(axis=2).any(axis=1)


def local_needs(held: Held, target_specs: Sequence[LeafSpec], targets: Sequence[Any]
                ) -> list[tuple[int, Index, bool]]:
  """(target position, region, whether its own copy was bad) of each region
  this host's devices hold that its own store has no good exact copy of."""
  out = []
  for pos, (spec, target) in enumerate(zip(target_specs, targets, strict=True)):
    leaf = held.leaf_of(spec)
    for region in target_regions(spec, target):
      if leaf is None or (leaf, region) not in held.exact:
        out.append((pos, region, leaf is not None and (leaf, region) in held.bad))
  return out


def encode_needs(lacks_header: bool, needs: Sequence[tuple[int, Index, bool]]) -> bytes:
  if not needs and not lacks_header:
    return b""
  return msgpack.packb([int(lacks_header), [[pos, [c for r in region for c in r], int(bad)]
                                            for pos, region, bad in needs]])


def decode_needs(blobs: Sequence[bytes]) -> tuple[list[Need], list[int]]:
  """Every host's needs in process order, and the hosts that lack the header."""
  needs: list[Need] = []
  lacking = []
  for host, blob in enumerate(blobs):
    if not blob:
      continue
    lacks, rows = msgpack.unpackb(blob)
    if lacks:
      lacking.append(host)
    for pos, flat, own_bad in rows:
      if len(flat) % 2:
        raise ValueError(f"host {host}'s needs: a region with an odd count of bounds")
      bounds = iter(map(int, flat))
      needs.append(Need(host, int(pos), tuple(zip(bounds, bounds, strict=False)),
                        bool(own_bad)))
  return needs, lacking


# ---------------------------------------------------------------- holders
def holder_values(held: Held, needs: Sequence[Need], target_specs: Sequence[LeafSpec],
                  num_hosts: int) -> np.ndarray:
  """This host's part of the holders' minimum: for need ``i``, at ``i`` its
  distance after the needer if it holds an exact copy, at ``len(needs) + i``
  if it holds an overlapping one; :data:`NONE` elsewhere; and last, 0 if
  it holds the step and the abstract state does not match it."""
  out = np.full(2 * len(needs) + 1, NONE, np.int32)
  if held.manifest is None:
    return out
  try:  # the last slot: 0 where a holder finds the abstract state does not match
    check_compatible(held.manifest.leaves, target_specs, step=held.manifest.step)
  except errors.TreeMismatchError:
    out[-1] = 0
  near: dict[int, list[int]] = {}  # leaf -> the needs it holds no exact copy of
  for i, need in enumerate(needs):
    leaf = held.leaf_of(target_specs[need.pos])
    if leaf is None:
      continue
    if (leaf, need.region) in held.exact:
      out[i] = (held.host - need.needer) % num_hosts
    else:
      near.setdefault(leaf, []).append(i)
  for leaf, which in near.items():
    hits = held.overlapping(leaf, [needs[i].region for i in which])
    for i in np.asarray(which)[hits].tolist():
      out[len(needs) + i] = (held.host - needs[i].needer) % num_hosts
  return out


def verdict(needs: Sequence[Need], mins: np.ndarray, cand: Candidate, num_hosts: int,
            target_specs: Sequence[LeafSpec]) -> tuple[int, ...] | Lost | Fallback:
  """Each need's holder (:data:`REBUILT` where no host holds it and the
  step carries parity), or why the step cannot restore this way."""
  n = len(needs)
  holders = []
  layout = None
  for i, need in enumerate(needs):
    exact, near = int(mins[i]), int(mins[n + i])
    if exact != NONE:
      holders.append((need.needer + exact) % num_hosts)
    elif near != NONE:
      layout = layout or _what(need, target_specs)
    elif cand.parity:
      holders.append(REBUILT)
    else:
      return Lost(f"step {cand.step}: no surviving copy of {_what(need, target_specs)}")
  if layout is not None:
    return Fallback(f"the target layout differs from the saved one ({layout} is no saved "
                    "piece)")
  return tuple(holders)


def _what(need: Need, target_specs: Sequence[LeafSpec]) -> str:
  return (f"host {need.needer}'s piece {list(need.region)} of leaf "
          f"{target_specs[need.pos].path!r}")


# ------------------------------------------------------------------- rows
def encode_rows(held: Held, needs: Sequence[Need], holders: Sequence[int],
                target_specs: Sequence[LeafSpec], header: bytes | None,
                parity: Sequence[Any] = ()) -> bytes:
  """The records of the needs this host sends, the header if asked, and
  its parity offers (:func:`snapstore._multihost.rebuild.offers`)."""
  rows = []
  for i, (need, h) in enumerate(zip(needs, holders, strict=True)):
    if h != held.host:
      continue
    rec = held.record(held.by_path[target_specs[need.pos].path], need.region)
    rows.append([i, rec.nbytes, list(rec.checksum), rec.owner, rec.kind.value])
  if not rows and header is None and not parity:
    return b""
  return msgpack.packb([rows, header, list(parity)], use_bin_type=True)


def decode_rows(blobs: Sequence[bytes]
                ) -> tuple[dict[int, list[Any]], bytes | None, dict[int, list[Any]]]:
  """The rows by need, the header, and each host's parity offers."""
  rows: dict[int, list[Any]] = {}
  header = None
  parity: dict[int, list[Any]] = {}
  for host, blob in enumerate(blobs):
    if not blob:
      continue
    got, head, offers = msgpack.unpackb(blob)
    for row in got:
      rows[int(row[0])] = row
    if head is not None:
      header = head
    if offers:
      parity[host] = offers
  return rows, header, parity


def header_from(blob: bytes, digest: int) -> Header:
  """The header a host received, checked against the agreed digest."""
  from .._manifest import _int, _str  # (defensive parsing, as manifests are parsed)
  if digest_of(blob) != digest:
    raise ValueError("the step's header does not match the digest its hosts agreed on")
  leaves, scalars, extra, chunk_bytes, tree_digest, num_hosts = msgpack.unpackb(
      blob, strict_map_key=False)
  return Header(tuple(spec_from_row(r) for r in leaves), {_int(k): v for k, v in scalars},
                extra, _int(chunk_bytes, 1), _str(tree_digest), _int(num_hosts, 1))


# -------------------------------------------------------------- the plan
def plan(coll: Collective, manifest: Manifest | None, cand: Candidate,
         target_specs: Sequence[LeafSpec], targets: Sequence[Any], *,
         bad: Collection[CopyKey] = ()) -> Planned | Lost | Fallback:
  """Needs, holders and rows for ``cand`` (``manifest``: this host's of that
  step and incarnation, or None). Collective; the same verdict everywhere."""
  host, n = coll.host, coll.num_hosts
  held = Held(host, manifest, bad)
  mine = local_needs(held, target_specs, targets)
  needs, lacking = decode_needs(gather_blobs(coll, encode_needs(manifest is None, mine)))
  if not needs and not lacking and manifest is not None:
    return Planned(cand, Header.of(manifest), (), (), (), (), ())
  mins = coll.reduce_min(holder_values(held, needs, target_specs, n))
  if mins[-1] == 0:  # every host raises alike (a holder says which leaf)
    if manifest is not None:
      check_compatible(manifest.leaves, target_specs, step=cand.step)
    raise errors.TreeMismatchError(
        f"the snapshot of step {cand.step} does not match the abstract state (the hosts "
        "that hold it name the leaf). Pass an abstract state with the structure that "
        "was saved.", leaf="")
  got = verdict(needs, mins, cand, n, target_specs)
  if not isinstance(got, tuple):
    return got
  holders = got
  send_header = bool(lacking) and manifest is not None and host == int(cand.holders[0])
  head = shared_content(manifest) if send_header and manifest is not None else None
  rebuilding = REBUILT in holders
  # the members to rebuild: hosts without the step, and those whose own copy
  # of a piece no other host holds failed its check
  lost_hosts = (cand.missing(n) | {needs[i].needer for i, h in enumerate(holders)
                                   if h == REBUILT and needs[i].own_bad}) if rebuilding else set()
  offers = rebuild.offers(host, manifest, lost_hosts, held.exact, bad) if rebuilding else []
  rows, header_blob, parity = decode_rows(gather_blobs(coll, encode_rows(
      held, needs, holders, target_specs, head, offers)))
  header: Header | None = Header.of(manifest) if manifest is not None else None
  if lacking:  # every host learns whether each that lacked it got it intact
    if header is None:
      try:
        header = header_from(header_blob or b"", cand.digest)
      except (ValueError, TypeError, KeyError):
        header = None
    if coll.reduce_min(np.array([0 if header is None else 1], np.int32))[0] == 0:
      return Lost(f"step {cand.step}: its header did not reach every host that lacks it "
                  "intact")
  assert header is not None  # (lacking is empty: every host has the manifest)
  by_path = {s.path: i for i, s in enumerate(header.leaves)}
  stripes: list[rebuild.Stripe] = []
  if rebuilding:
    wanted = [(needs[i].needer, by_path[target_specs[needs[i].pos].path], needs[i].region)
              for i, h in enumerate(holders) if h == REBUILT]
    stripes, why = rebuild.decide(cand.step, parity, lost_hosts, wanted, len(header.leaves))
    if why is not None:
      return Lost(why)
  kinds = {k.value: k for k in ChecksumKind}
  incoming = []
  for i, need in enumerate(needs):
    if need.needer == host and holders[i] != REBUILT:
      row = rows[i]
      leaf = by_path[target_specs[need.pos].path]
      rec = PieceRecord(leaf, need.region, 0, int(row[1]), tuple(int(c) for c in row[2]),
                        int(row[3]), kinds[row[4]])
      incoming.append(Incoming(i, holders[i], rec))
  itemsize = [s.np_dtype.itemsize if s.dtype else 0 for s in header.leaves]
  nbytes = tuple(int(rows[i][1]) if h != REBUILT else
                 index_nbytes(needs[i].region, itemsize[by_path[target_specs[needs[i].pos].path]])
                 for i, h in enumerate(holders))
  return Planned(cand, header, tuple(needs), holders, nbytes, tuple(incoming),
                 tuple(i for i, h in enumerate(holders) if h == host), tuple(stripes))


def manifests_at(manifests: Iterable[Manifest], cand: Candidate) -> Manifest | None:
  """This host's manifest of the candidate's step and incarnation, if any."""
  for m in manifests:
    if m.step == cand.step and m.incarnation == cand.incarnation:
      return m
  return None
