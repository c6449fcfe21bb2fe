"""What a worker tells its supervisor: files in ``$SNAPSTORE_REPORT_DIR``.

The supervisor (``snapstore launch``, or a production one that speaks the
same files) sets ``$SNAPSTORE_REPORT_DIR``, ``$SNAPSTORE_INCARNATION`` and
``$SNAPSTORE_HOST`` for each worker; each function here is a no-op without
them. The engine writes what only it knows: which processes are missing
(the supervisor fences those still running), each change of the job's
hosts, and why it asks for a full restart (:mod:`snapstore.recovery`). The
worker writes its own restore and state digests (host 0; one writer per
report). Every file is written atomically; the supervisor reads them
after the fact and never trusts a malformed one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._manifest import write_atomic

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: a worker's "restart the whole job"
REPORT_DIR_ENV = "SNAPSTORE_REPORT_DIR"
INCARNATION_ENV = "SNAPSTORE_INCARNATION"
IN_PLACE_ENV = "SNAPSTORE_IN_PLACE"


def incarnation_from_env() -> int | None:
  """``$SNAPSTORE_INCARNATION`` (set for each worker by ``snapstore launch``), or None."""
  value = os.environ.get(INCARNATION_ENV, "")
  return int(value) if value.isdigit() else None


def report_restore(summary: dict[str, Any], incarnation: int) -> None:
  """Under ``snapstore launch`` (``SNAPSTORE_REPORT_DIR`` set): host 0's
  worker records its restore (``RestoreResult.summary()``, or its own)
  where the supervisor reads it for its incarnation report (one job
  incarnation may restore several times when it recovers in place)."""
  where = os.environ.get(REPORT_DIR_ENV)
  if where:
    job = incarnation_from_env()
    path = Path(where) / f"restore-inc{incarnation if job is None else job}.json"
    doc = json.loads(path.read_text()) if path.exists() else []
    doc.append(dict(summary, incarnation=incarnation, time=time.time()))
    write_atomic(path, json.dumps(doc).encode())


def report_missing(processes: Sequence[int], since: float) -> None:
  """Under ``snapstore launch``: this process has seen ``processes`` missing from
  the job's live members (the coordination service's heartbeats) since
  ``since``; the supervisor fences those that are still running (hung)."""
  path = _child_report("missing", per_host=True)
  if path is not None:
    write_atomic(path, json.dumps({"missing": sorted(processes), "since": since}).encode())


def _child_report(kind: str, *, per_host: bool = False) -> Path | None:
  """Where a worker under ``snapstore launch`` writes its ``kind`` report for the
  supervisor (``<kind>-inc<incarnation>[-host<host>].json``), or None when
  it does not run under ``launch``."""
  where, job, me = (os.environ.get(REPORT_DIR_ENV), incarnation_from_env(),
                    os.environ.get("SNAPSTORE_HOST", ""))
  if not where or job is None or (per_host and not me.isdigit()):
    return None
  return Path(where) / (f"{kind}-inc{job}" + (f"-host{me}" if per_host else "") + ".json")


def report_restart(why: str) -> None:
  """Under ``snapstore launch``: why this worker asks for a full restart (it
  exits with :data:`RESTART_EXIT_CODE` next); ``Incarnation.fallback``
  carries it."""
  path = _child_report("restart", per_host=True)
  if path is not None:
    write_atomic(path, json.dumps(why).encode())


def report_resize(change: dict[str, Any], *, replace_last: bool = False) -> None:
  """Under ``snapstore launch``: the job went on with other processes than
  before (``recovery.Resize.as_dict()``); the incarnation report lists
  every such change (``Incarnation.resizes``). ``replace_last``: the same
  change, now with its first step's time."""
  path = _child_report("resize")
  if path is not None:
    doc = json.loads(path.read_text()) if path.exists() else []
    if replace_last and doc and doc[-1]["formed_at"] == change["formed_at"]:
      doc.pop()
    doc.append(change)
    write_atomic(path, json.dumps(doc).encode())


def report_digest(step: int, digest: str, incarnation: int) -> None:
  """Under ``snapstore launch``: host 0 records the global state's digest at
  ``step``; the supervisor's report (``--json``) carries them per incarnation,
  so runs can be compared bitwise from the command line."""
  where = os.environ.get(REPORT_DIR_ENV)
  if where:
    path = Path(where) / f"digests-inc{incarnation}.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[str(step)] = digest
    write_atomic(path, json.dumps(doc).encode())
