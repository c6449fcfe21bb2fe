"""``snapstore inspect``: what each host store of a run holds, each
manifest's verdict, the lineage, and what ``restore`` would pick. Reads only:
it creates, changes and deletes nothing, and refuses nothing but what it
cannot read."""

from __future__ import annotations

import os
import re
from concurrent import futures
from pathlib import Path
from typing import Any

from . import _planner
from ._backends import open_regular, scan
from ._checksum import ChecksumKind, crc_matches, piece_key
from ._manifest import Manifest
from ._parity import PARITY_PATH

_HOST_RE = re.compile(r"^host-(\d+)$")


def _verify(root: Path, m: Manifest, pool: futures.Executor) -> str | None:
  """None if every piece of ``m`` matches its checksum, else the first bad one."""
  import mmap

  import numpy as np
  fd = open_regular(root / f"slot-{m.slot}.bin")
  try:
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
  finally:
    os.close(fd)
  buf = np.frombuffer(mm, dtype=np.uint8)
  named = [(p, f"piece {p.index} of leaf {m.leaves[p.leaf].path!r}", m.leaves[p.leaf].path)
           for p in m.pieces]
  named += [(r.piece, f"parity block {r.block} of stripe {r.stripe}", PARITY_PATH)
            for r in m.parity]
  for p, what, path in named:
    if p.offset + p.nbytes > buf.nbytes:
      return f"{what} lies past the end of its slot file"
    if p.kind is not ChecksumKind.CRC32C or not crc_matches(
        buf[p.offset:p.offset + p.nbytes], p.checksum, chunk_bytes=m.chunk_bytes,
        key=piece_key(path, p.index), pool=pool):
      return f"checksum mismatch in {what}"
  return None


def _why_kept(step: int, watermark: int | None) -> str:
  if watermark is None:
    return "among the newest (keep); no watermark held here"
  if step == watermark:
    return "the job's watermark: every store held it at the last agreement"
  if step > watermark:
    return "newer than the watermark: kept, not yet known complete on every store"
  return "among the newest (keep)"


def inspect_store(store: os.PathLike[str] | str, *, run_id: str | None = None,
                  verify: bool = False) -> dict[str, Any]:
  """A report of ``<store_dir>/<run_id>`` (or one ``host-<h>`` directory):
  per manifest its verdict and why it is kept; per host the job's retention
  watermark it holds (:mod:`._watermark`); per incarnation the steps it
  wrote and whether a newer one superseded them; and the step ``restore``
  would choose from
  these stores (or why none). ``verify`` re-checks every piece's crc32c."""
  root = Path(store)
  hosts = sorted((int(hm[1]), root / e) for e in os.listdir(root)
                 if (hm := _HOST_RE.match(e)) and (root / e).is_dir())
  if not hosts and _HOST_RE.match(root.name):
    hosts, root = [(int(root.name.split("-")[1]), root)], root.parent
  run = run_id or root.name
  rows: list[dict[str, Any]] = []
  valid: list[Manifest] = []
  with futures.ThreadPoolExecutor(2) as pool:
    for host, hroot in hosts:
      for path, m, why in scan(hroot, run_id=run, host=host):
        row: dict[str, Any] = {"host": host, "file": path.name}
        if m is not None and verify:
          why = _verify(hroot, m, pool)
        if m is not None:
          row.update(step=m.step, incarnation=m.incarnation, slot=m.slot,
                     pieces=len(m.pieces), parity_blocks=len(m.parity), bytes=m.data_bytes,
                     leaves=len(m.leaves))
        if why is None:
          assert m is not None  # scan gives a manifest or why there is none
          valid.append(m)
        row["verdict"] = "valid" if why is None else f"invalid: {why}"
        rows.append(row)
  live = set(map(id, _planner.fence(valid)))
  marks = {h: _planner.watermark_of([m for m in valid if m.store == h]) for h, _ in hosts}
  for row, m in zip([r for r in rows if r["verdict"] == "valid"], valid, strict=True):
    if id(m) not in live:
      row["verdict"] = "superseded: a newer incarnation restarted from an earlier step"
    else:
      row["kept"] = _why_kept(m.step, marks.get(m.store))
  lineage: dict[int, dict[str, Any]] = {}
  for m in valid:
    entry = lineage.setdefault(m.incarnation, {"steps": set(), "live_steps": set()})
    entry["steps"].add(m.step)
    if id(m) in live:
      entry["live_steps"].add(m.step)
  reasons: list[str] = []
  plan = _planner.choose(valid, reasons=reasons)
  return {
      "store": str(root), "run_id": run, "hosts": [h for h, _ in hosts],
      "manifests": rows,
      # per host: the newest step every store held when it last saved (kept
      # until a newer one is; None: none agreed yet, or not held here)
      "watermarks": {str(h): w for h, w in marks.items()},
      "lineage": {str(inc): {"steps": sorted(e["steps"]), "live_steps": sorted(e["live_steps"])}
                  for inc, e in sorted(lineage.items())},
      "restore_would_pick": (
          {"step": plan.step, "incarnation": plan.incarnation, "stores": list(plan.stores),
           "rebuilt_from_parity": [{"stripe": rb.stripe, "host": rb.layout.members[rb.lost]}
                                   for rb in plan.rebuilds],
           "passed_over": reasons}
          if plan is not None else {"step": None, "why": reasons or ["no valid manifest"]}),
  }
