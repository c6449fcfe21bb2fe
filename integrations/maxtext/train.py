"""MaxText's own pre-training loop, with per-step snapstore snapshots.

::

  python -m snapstore.integrations.maxtext.train <MaxText yml> key=value ... \\
      snapshot_interval=1 snapshot_keep=2 snapshot_replicas=1

Everything but the ``snapshot_*`` keys goes to MaxText unchanged (its
``enable_checkpointing`` / ``checkpoint_period`` Orbax checkpoints included);
the ``snapshot_*`` keys may also sit in the yml (this module strips them
before MaxText's strict config sees them). ``snapshot_interval=0`` turns
snapshots off: the run is plain MaxText.

Two of MaxText's functions are wrapped (MaxText 0.2.5 has no hook for an
external checkpoint engine; these are the ones its loop looks up on the
``checkpointing`` module at each call):

* ``checkpointing.maybe_save_checkpoint``, called after every train step:
  MaxText's own Orbax save runs first, unchanged, then a snapshot of the
  whole train state (params, optimizer state, step, PRNG keys) is taken
  before the next step donates it.
* ``checkpointing.load_state_if_possible``, called once at start-up: the
  freshest complete snapshot of the job's host stores if there is one and it
  is newer than MaxText's latest Orbax checkpoint; else MaxText's own
  restore (Orbax, or a fresh init).

Under ``snapstore launch`` (``$SNAPSTORE_COORDINATOR`` set), the process joins
the job with :func:`snapstore.testing.worker.init_from_env` first; MaxText's CPU
start-up then finds ``jax.distributed`` initialized and skips its own (which
hard-codes port 1234). Each process writes a report (restores, losses,
digests of the global state) to ``$SNAPSTORE_REPORT_DIR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from snapstore import HostFiles, PinnedHost, _faults

from . import MaxTextConfigError, _elastic, snapshot_options, split_snapshot_keys

logger = logging.getLogger(__name__)

SUPPORTED_MAXTEXT = ("0.2.5",)


class UnsupportedMaxTextError(RuntimeError):
  """The installed MaxText is not one this module wraps."""


def check_maxtext() -> str:
  """The installed MaxText's version; raises :class:`UnsupportedMaxTextError`
  (with what to do) if it is missing or not one of ``SUPPORTED_MAXTEXT``."""
  try:
    from maxtext import version
  except ImportError as e:
    raise UnsupportedMaxTextError(
        "MaxText is not installed (Python >= 3.12: pip install --no-deps -r "
        "requirements/maxtext-0.2.5-cpu.txt)") from e
  found = getattr(version, "__version__", "unknown")
  if found not in SUPPORTED_MAXTEXT:
    raise UnsupportedMaxTextError(
        f"maxtext {found} is installed; snapstore.integrations.maxtext.train wraps "
        f"MaxText's train loop of version {', '.join(SUPPORTED_MAXTEXT)} only (the two "
        "functions it wraps are not a public API). Install a supported version, or "
        "use snapstore.integrations.maxtext.SnapshotHook in your own loop.")
  return found


def _yaml_without_snapshot_keys(path: str) -> tuple[str, dict[str, Any]]:
  """(a yml MaxText accepts, the ``snapshot_*`` keys of ``path``). A copy is
  written only if ``path`` has such keys; its ``base_config`` is made absolute
  so the copy resolves it as the original did."""
  import yaml  # MaxText's dependency
  if not Path(path).is_file():  # a key=value, or a path MaxText resolves itself
    return path, {}
  doc = yaml.safe_load(Path(path).read_text()) or {}
  keys = {k: v for k, v in doc.items() if str(k).startswith("snapshot_")}
  if not keys:
    return path, {}
  rest = {k: v for k, v in doc.items() if k not in keys}
  here = Path(path).resolve().parent
  base = rest.get("base_config")
  if base and not os.path.isabs(base) and (here / base).is_file():
    rest["base_config"] = str(here / base)
  # Beside the original when possible: MaxText looks for models/<name>.yml there.
  fd, copy = tempfile.mkstemp(prefix=".snapstore-", suffix=".yml",
                              dir=here if os.access(here, os.W_OK) else None)
  with os.fdopen(fd, "w") as f:
    yaml.safe_dump(rest, f)
  return copy, keys


class _Engine:
  """The snapshot side of one MaxText process: built lazily (at MaxText's
  restore, when JAX is up), reports under ``snapstore launch``."""

  def __init__(self, config: dict[str, Any]):
    self.options = snapshot_options(config)  # raises MaxTextConfigError
    self.manager: Any = None
    self.report: dict[str, Any] = {"losses": {}, "times": {}, "restores": [], "digests": {},
                                   "elastic": [], "pid": os.getpid(), "started": time.time()}
    self._report_dir = os.environ.get("SNAPSTORE_REPORT_DIR")
    self._elastic: _elastic.ElasticSide | None = None  # single-controller elastic MaxText

  @property
  def enabled(self) -> bool:
    return self.options is not None

  def _manager(self, maxtext_config: Any = None) -> Any:
    """Built at MaxText's restore, when JAX is up, under the run name MaxText
    resolved (its yml chain, ``M_RUN_NAME``, ... not only the command line):
    a run never restores another run's snapshots."""
    if self.manager is None:
      import snapstore
      name = getattr(maxtext_config, "run_name", None)
      if name:
        self.options = dataclasses.replace(self.options, run_id=str(name))
      # Single-controller elastic (Pathways): one store per slice, held in
      # the slices' own pinned host memory; else this host's store.
      slices = self._elastic.slices() if self._elastic is not None else None
      self.manager = snapstore.SnapshotManager(self.options, slices=slices)
      if self._elastic is not None:
        self._elastic.manager = self.manager
        self._elastic.before_attempt(count=False)
    return self.manager

  def elastic_retry(self, original: Callable[..., Any], config: Any,
                    callback_fn: Callable[[], Any] | None = None,
                    pre_callback_fn: Callable[[], Any] | None = None) -> Any:
    """MaxText's ``elastic_utils.elastic_retry``, with snapstore's two
    callbacks chained into MaxText's (MaxText runs its own cleanup first):
    on the event, the slices that were active and are down then are
    forgotten; before each attempt, the active ones are set."""
    if self.enabled and getattr(config, "dataset_type", None) == "grain":
      raise MaxTextConfigError(
          "dataset_type=grain with elastic_enabled=true: snapstore cannot yet carry the "
          "grain iterator's state across a change of slices; set snapshot_interval=0 "
          "(MaxText's own checkpoints) or use another dataset_type")
    self._elastic = _elastic.ElasticSide(config, self.report, snapshots=self.enabled)
    side = self._elastic
    return original(config, callback_fn=_elastic.chain(side.on_event, callback_fn),
                    pre_callback_fn=_elastic.chain(side.before_attempt, pre_callback_fn))

  # ----------------------------------------------------------- the wraps
  def load_state_if_possible(self, original: Callable[..., Any], *args: Any,
                             **kwargs: Any) -> Any:
    from maxtext.common import checkpointing

    import snapstore
    bound = inspect.signature(original).bind(*args, **kwargs)
    abstract = bound.arguments["abstract_unboxed_pre_state"]
    orbax = bound.arguments.get("checkpoint_manager")
    orbax_step = checkpointing.latest_step(orbax) if orbax is not None else None
    t0 = time.time()
    r, why = None, "snapshots are off (snapshot_interval=0)"
    grain = bound.arguments.get("dataset_type") == "grain"
    if self.enabled:
      if grain:
        abstract = {"maxtext": abstract, "data_iterator": _iterator_rows_abstract()}
      try:
        r = self._manager(bound.arguments.get("maxtext_config")).restore(abstract)
      except snapstore.NothingToRestoreError as e:
        why = f"no complete snapshot ({e})"
    if r is None or (orbax_step is not None and orbax_step > r.step):
      if r is not None:
        why = f"MaxText's Orbax step {orbax_step} is newer than snapshot step {r.step}"
        r = None  # its arrays are not needed: free them before MaxText reads its own
      t1 = time.time()
      out = original(*args, **kwargs)
      summary = {"source": "maxtext" if orbax_step is not None else "init",
                 "step": orbax_step, "why": why, "timings": {"total": time.time() - t1}}
      self._record_restore(summary, t0)
      if self._elastic is not None:
        self._elastic.restored(self.report["restores"][-1])
      return out
    state = r.state
    if grain:
      _set_iterator_state(bound.arguments.get("data_iterator"), state["data_iterator"])
      state = state["maxtext"]
    self._record_restore(r.summary(), t0)
    self._digest(state, r.step)
    if self._elastic is not None:
      self._elastic.restored(self.report["restores"][-1])
    if isinstance(orbax, (checkpointing.EmergencyCheckpointManager,
                          checkpointing.EmergencyReplicatorCheckpointManager)):
      return state, None  # MaxText takes these managers' restore as it is
    return {"items": state}, None

  def maybe_save_checkpoint(self, original: Callable[..., Any], checkpoint_manager: Any,
                            state: Any, config: Any, data_iterator: Any,
                            step: int | None = None) -> Any:
    if self._elastic is not None and step is not None:
      self._elastic.stepped(int(step))  # trained: MaxText's save may signal a scale-up
    try:
      out = original(checkpoint_manager, state, config, data_iterator, step)
    except _elastic.scale_up_signal() as e:
      # MaxText asks to scale up right after its Orbax save, before this
      # step's snapshot: take it first, so the scale-up rewinds 0 steps.
      # The signal goes on whatever happens here (a failed snapshot only
      # means the rewind is MaxText's).
      if step is not None and self.enabled:
        try:
          saved = self._save(config, state, data_iterator, int(step), force=True)
          self.manager.wait_until_finished()
        except Exception as failure:  # noqa: BLE001 - never replace the signal
          logger.warning("step %s: no snapshot before the scale-up: %r", step, failure)
        else:
          if saved:
            e.add_note(f"snapstore: step {step} snapshotted before the scale-up")
      raise
    if step is None:  # the end of the run: the final state
      if self.manager is not None:
        self.manager.wait_until_finished()
      self._digest(state, int(config.steps) - 1)
      self._write()
      return out
    if _faults.armed("step", int(step)):  # a test's seeded SIGKILL (snapstore launch):
      import jax  # after this step computed and the previous
      jax.block_until_ready(state)      # snapshot committed, before this one
      if self.manager is not None:
        self.manager.wait_until_finished()
      _faults.point("step", int(step))
    self.report["times"][int(step)] = time.time()  # the step and MaxText's own save done
    if self.enabled:
      self._save(config, state, data_iterator, int(step))
    return out

  def _save(self, config: Any, state: Any, data_iterator: Any, step: int, *,
            force: bool = False) -> bool:
    if getattr(config, "dataset_type", None) == "grain":  # as MaxText's own save takes it
      state = {"maxtext": state, "data_iterator": _iterator_rows(data_iterator)}
    return bool(self._manager(config).save(step, state, force=force))

  def write_metrics(self, original: Callable[..., Any], logger: Any, metrics: Any,
                    step: int, *args: Any, **kwargs: Any) -> Any:
    loss = (metrics or {}).get("scalar", {}).get("learning/loss")
    if loss is not None:
      self.report["losses"][int(step)] = float(loss)
      self._write()
    return original(logger, metrics, step, *args, **kwargs)

  # ------------------------------------------------------------- reports
  def _record_restore(self, summary: dict[str, Any], t0: float) -> None:
    """Into this process's report, and (host 0) the supervisor's: the
    restore that won (a snapshot, or MaxText's own), once."""
    summary = dict(summary, started=t0, ended=time.time())
    self.report["restores"].append(summary)
    if self._report_dir:
      import jax

      from snapstore.testing import incarnation_from_env, report_restore
      if jax.process_index() == 0:
        report_restore(summary, incarnation_from_env() or 0)
    self._write()

  def _digest(self, state: Any, step: int) -> None:
    """Under ``snapstore launch``: the sha256 of the global state (every
    byte gathered to every process by one jitted identity), by host 0."""
    if not self._report_dir:
      return
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from snapstore.testing import global_digest, incarnation_from_env, report_digest
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(state)
                if isinstance(getattr(x, "sharding", None), NamedSharding))
    value = global_digest(state, NamedSharding(mesh, PartitionSpec()))
    self.report["digests"][int(step)] = value
    if jax.process_index() == 0:
      report_digest(int(step), value, incarnation_from_env() or 0)

  def _write(self) -> None:
    if not self._report_dir:
      return
    import jax

    from snapstore._manifest import write_atomic
    inc = os.environ.get("SNAPSTORE_INCARNATION", "0")
    attempt = os.environ.get("SNAPSTORE_ATTEMPT", "0")
    name = f"maxtext-inc{inc}-host{jax.process_index()}" + (
        f"-r{attempt}" if attempt != "0" else "")
    if self.manager is not None:
      self.report["save_metrics"] = self.manager.metrics.as_dict()
      self.report["store"] = _store_name(self.manager.store)
    write_atomic(Path(self._report_dir) / f"{name}.json", json.dumps(self.report).encode())

  def close(self) -> None:
    if self.manager is not None:
      self.manager.close()


# The grain iterator's state travels in the snapshot as one row of bytes per
# process of a (processes, ITERATOR_ROW_BYTES) uint8 array sharded by
# process: replicated across failure domains and checked like every shard.
ITERATOR_ROW_BYTES = 1 << 14


def _store_name(store: Any) -> str:
  """The report's name of the store a manager chose (``Auto()`` resolved)."""
  return {HostFiles: "host_files", PinnedHost: "pinned_host"}.get(type(store),
                                                                  type(store).__name__)


def _grain_iterator(data_iterator: Any) -> Any:
  """The grain iterator whose state a snapshot carries; None on a host that
  loads no data (MaxText's placeholder iterator). Every host makes the same
  call (``dataset_type=grain``), so the snapshot's tree is the same everywhere."""
  if isinstance(data_iterator, list) or type(data_iterator).__name__ == "RemoteIteratorWrapper":
    raise NotImplementedError(
        f"dataset_type=grain with a {type(data_iterator).__name__} iterator (a list of "
        "iterators, or a remote one): snapstore cannot carry its state yet; set "
        "snapshot_interval=0")
  it = getattr(data_iterator, "local_iterator", None)
  return it if it is not None and hasattr(it, "get_state") and hasattr(it, "set_state") else None


def _rows_sharding() -> Any:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("process", "local"))
  return NamedSharding(mesh, PartitionSpec("process"))


def _iterator_rows_abstract() -> Any:
  import jax
  import numpy as np
  return jax.ShapeDtypeStruct((jax.process_count(), ITERATOR_ROW_BYTES), np.uint8,
                              sharding=_rows_sharding())


def _iterator_rows(data_iterator: Any) -> Any:
  """This process's iterator state as its row of the global array: kind
  (``B`` bytes, ``J`` JSON, ``N`` none: a host that loads no data), the
  process index (4 bytes), the length (4 bytes), the payload."""
  import jax
  import numpy as np
  iterator = _grain_iterator(data_iterator)
  state = None if iterator is None else iterator.get_state()
  kind, payload = ((b"N", b"") if iterator is None else
                   (b"B", bytes(state)) if isinstance(state, (bytes, bytearray))
                   else (b"J", json.dumps(state).encode()))
  blob = (kind + jax.process_index().to_bytes(4, "little") + len(payload).to_bytes(4, "little")
          + payload)
  if len(blob) > ITERATOR_ROW_BYTES:
    raise ValueError(f"the grain iterator's state is {len(blob)} bytes; snapshots carry "
                     f"at most {ITERATOR_ROW_BYTES}")
  row = np.zeros((1, ITERATOR_ROW_BYTES), np.uint8)
  row[0, :len(blob)] = np.frombuffer(blob, np.uint8)
  abstract = _iterator_rows_abstract()
  return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda _: row)


def _set_iterator_state(data_iterator: Any, rows: Any) -> None:
  """Sets this process's iterator to the state in its own row (checked: the
  row names the process that wrote it)."""
  import jax
  import numpy as np
  row = np.asarray(rows.addressable_shards[0].data).reshape(-1).tobytes()
  kind = row[:1]
  writer, size = int.from_bytes(row[1:5], "little"), int.from_bytes(row[5:9], "little")
  if kind not in (b"B", b"J", b"N") or size > len(row) - 9:
    raise ValueError("the snapshot's grain iterator state is malformed")
  if writer != jax.process_index():
    raise ValueError(f"process {jax.process_index()} got the grain iterator state of "
                     f"process {writer}")
  iterator = _grain_iterator(data_iterator)
  if (kind == b"N") != (iterator is None):
    raise ValueError("the snapshot's grain iterator state does not match this host's "
                     "data loader (one loads data, the other does not)")
  if iterator is not None:
    payload = row[9:9 + size]
    iterator.set_state(payload if kind == b"B" else json.loads(payload))


#: the engine of the running :func:`main` (None outside it), for tools and
#: tests that look at its manager or report
current: _Engine | None = None


def _wrap(module: Any, name: str, method: Callable[..., Any]) -> None:
  original = getattr(module, name)

  @functools.wraps(original)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    return method(original, *args, **kwargs)
  setattr(module, name, wrapped)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2:
    raise SystemExit(__doc__)
  check_maxtext()
  yml, from_yml = _yaml_without_snapshot_keys(argv[1])
  rest, from_cli = split_snapshot_keys(argv[2:])
  engine = _Engine({**from_yml, **from_cli, **_run_keys(rest, yml)})
  global current
  current = engine
  if os.environ.get("SNAPSTORE_COORDINATOR"):  # under snapstore launch: join first
    from snapstore.testing import init_from_env
    init_from_env()
  from maxtext.common import checkpointing, metric_logger
  from maxtext.trainers.pre_train import train
  from maxtext.utils import elastic_utils
  _wrap(checkpointing, "load_state_if_possible", engine.load_state_if_possible)
  _wrap(checkpointing, "maybe_save_checkpoint", engine.maybe_save_checkpoint)
  _wrap(metric_logger.MetricLogger, "write_metrics", engine.write_metrics)
  _wrap(elastic_utils, "elastic_retry", engine.elastic_retry)  # looked up at call time
  from absl import (
    flags,
    logging as absl_logging,
  )
  flags.FLAGS(argv[:1])  # MaxText reads absl flags (defaults) without app.run
  absl_logging.set_verbosity(absl_logging.INFO)  # MaxText's step log, as under app.run
  try:
    train.main([argv[0], yml, *rest])
  finally:
    engine.close()
    if yml != argv[1]:
      with contextlib.suppress(OSError):
        os.unlink(yml)
  return 0


def _run_keys(args: Sequence[str], yml: str) -> dict[str, Any]:
  """The MaxText keys snapstore reads too (``run_name``), from the command
  line, else the yml."""
  for a in args:
    if a.startswith("run_name="):
      return {"run_name": a.partition("=")[2]}
  import yaml
  if not Path(yml).is_file():
    return {}
  doc = yaml.safe_load(Path(yml).read_text()) or {}
  return {"run_name": doc["run_name"]} if doc.get("run_name") else {}


if __name__ == "__main__":
  try:
    raise SystemExit(main())
  except (MaxTextConfigError, UnsupportedMaxTextError) as e:
    sys.stderr.write(f"snapstore: {e}\n")
    raise SystemExit(2) from None
