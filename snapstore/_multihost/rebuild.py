"""Parity rebuilds in the sparse restore: only a lost host's stripes take part.

A need no host holds a copy of (:mod:`snapstore._multihost.sparse`), in a step that carries
parity, is looked for in the stripes (:mod:`._parity`) with a member that
does not hold the step. Each surviving member of such a stripe offers its parity block
(and says whether its block and its own pieces are usable); the lowest
survivor also sends the stripe's layout, which the needer has lost. Every
host derives the same verdict: each stripe has exactly one lost member and
a usable block from every other, and every such need is a piece of a lost
member, or the step is lost here (the reason names the group, as the full
exchange does). Each survivor then sends its share of the rebuild (its
block added, its own pieces subtracted, :func:`._parity.contribution`)
straight to each host that needs the stripe's pieces (the lost member's
replacement, where the target is laid out as saved), which sums the ``k``
shares: one stripe's bytes cross the network ``k`` times a needer, and no
other host sees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _parity
from .._index import Index
from .._manifest import Manifest, ParityRecord
from .._planner import CopyKey


@dataclasses.dataclass(frozen=True)
class Stripe:
  """One stripe to rebuild: its members (hosts), its layout, the lost
  member, and the hosts that need its pieces (the lost member's
  replacement; others too, where the target order moved them)."""

  stripe: int
  layout: _parity.StripeMembers
  lost: int
  needers: tuple[int, ...]


def _record_usable(host: int, step: int, m: Manifest, r: ParityRecord,
                   bad: Collection[CopyKey], held: Mapping[tuple[int, Index], Any]) -> bool:
  """True if this host's block of ``r`` and its own pieces in the stripe are
  not known bad and are held."""
  if (host, step, r.piece.leaf, r.piece.index) in bad:
    return False
  mine = r.members.index(host) if host in r.members else -1
  return mine >= 0 and all(key in held for key in r.layout[mine])


def offers(host: int, manifest: Manifest | None, lost_hosts: Collection[int],
           held: Mapping[tuple[int, Index], Any], bad: Collection[CopyKey]) -> list[Any]:
  """This host's parity offers: for each of its blocks in a stripe with a
  lost member, (stripe, block, members, length, usable, the layout if this
  host is the stripe's lowest survivor else None)."""
  out: list[Any] = []
  if manifest is None:
    return out
  for r in manifest.parity:
    if not any(m in lost_hosts for m in r.members):
      continue
    survivors = [m for m in r.members if m not in lost_hosts]
    # the layout, from the lowest survivor, where one member is lost (two:
    # the stripe cannot be rebuilt, every host sees it from the members)
    layout = ([[[leaf, [list(p) for p in idx]] for leaf, idx in member] for member in r.layout]
              if len(survivors) == len(r.members) - 1 and host == min(survivors) else None)
    out.append([r.stripe, r.block, list(r.members), r.length,
                _record_usable(host, manifest.step, manifest, r, bad, held), layout])
  return out


def _layout_from(row: Any, members: tuple[int, ...], length: int,
                 num_leaves: int) -> _parity.StripeMembers:
  """A stripe layout received from its lowest survivor, checked for shape."""
  if not isinstance(row, list) or len(row) != len(members):
    raise ValueError("a parity layout with the wrong number of members")
  pieces = []
  for member in row:
    got = []
    for leaf, idx in member:
      leaf = int(leaf)
      if not 0 <= leaf < num_leaves:
        raise ValueError(f"a parity layout names leaf {leaf} of {num_leaves}")
      got.append((leaf, tuple((int(a), int(b)) for a, b in idx)))
    pieces.append(tuple(got))
  k = len(members) - 1
  if k < 1 or length <= 0 or length % (4 * k):
    raise ValueError(f"a parity stripe of {len(members)} members and length {length}")
  return _parity.StripeMembers(members, tuple(pieces), length)


def decide(step: int, rows: Mapping[int, Sequence[Any]], lost_hosts: Collection[int],
           wanted: Collection[tuple[int, int, Index]], num_leaves: int
           ) -> tuple[list[Stripe], str | None]:
  """The stripes to rebuild from every host's offers (``rows``: host ->
  its offers), or why the step cannot restore this way. ``lost_hosts``:
  the hosts without the step; ``wanted``: (needer, saved leaf, region) of
  each need no host holds."""
  by_stripe: dict[int, dict[int, tuple[int, bool]]] = {}
  meta: dict[int, tuple[tuple[int, ...], int]] = {}
  layouts: dict[int, Any] = {}
  for host in sorted(rows):
    for stripe, block, members, length, usable, layout in rows[host]:
      members, block = tuple(int(m) for m in members), int(block)
      if (meta.setdefault(stripe, (members, int(length))) != (members, int(length))
          or not 0 <= block < len(members) or members[block] != host
          or block in by_stripe.get(stripe, {}) or (layout is not None and stripe in layouts)):
        # (every host sees the same offers: the same verdict everywhere)
        return [], (f"step {step}: the parity blocks of stripe {stripe} disagree on its "
                    "layout")
      by_stripe.setdefault(stripe, {})[block] = (host, bool(usable))
      if layout is not None:
        layouts[stripe] = layout
  found = []
  for stripe in sorted(by_stripe):
    members, length = meta[stripe]
    group = f"group of hosts {list(members)} (stripe {stripe})"
    lost = [x for x, m in enumerate(members) if m in lost_hosts]
    if len(lost) > 1:
      return [], (f"step {step}: the {group} lost hosts {[members[x] for x in lost]}; "
                  "parity rebuilds one lost host of a group")
    x = lost[0]
    blocks = by_stripe[stripe]
    gone = [j for j in range(len(members)) if j != x and not blocks.get(j, (0, False))[1]]
    if gone or stripe not in layouts:
      return [], (f"step {step}: the {group} lost host {members[x]} and the parity blocks "
                  f"of hosts {[members[j] for j in gone]} are unusable")
    try:
      layout = _layout_from(layouts[stripe], members, length, num_leaves)
    except (ValueError, TypeError) as e:  # (every host parses the same bytes)
      return [], f"step {step}: the {group}'s layout is malformed ({e})"
    found.append((stripe, layout, x))
  where = {piece: at for at, (_, layout, x) in enumerate(found) for piece in layout.pieces[x]}
  needers: dict[int, set[int]] = {}
  for needer, leaf, idx in wanted:
    at = where.get((leaf, idx))
    if at is None:
      return [], (f"step {step}: no surviving copy or parity stripe of host {needer}'s "
                  f"piece {list(idx)} of leaf {leaf}")
    needers.setdefault(at, set()).add(needer)
  return [Stripe(stripe, layout, x, tuple(sorted(needers[at])))
          for at, (stripe, layout, x) in enumerate(found) if at in needers], None


def share(stripe: Stripe, host: int, itemsize: Any, piece: Any, block: Any) -> np.ndarray:
  """This host's share of ``stripe``'s rebuild, as bytes (``piece(leaf,
  index)``: its own pieces' flat bytes; ``block()``: its parity block's)."""
  mine = stripe.layout.members.index(host)
  own = set(stripe.layout.pieces[mine])
  words = _parity.contribution(
      stripe.layout, stripe.lost, itemsize,
      lambda leaf, idx: piece(leaf, idx) if (leaf, idx) in own else None,
      lambda j: block() if j == mine else None)
  return words.view(np.uint8)


def pieces(stripe: Stripe, total: np.ndarray, itemsize: Any
           ) -> list[tuple[int, Index, np.ndarray]]:
  """The lost member's pieces from the sum of every share."""
  return _parity.split(stripe.layout, stripe.lost, total, itemsize)
