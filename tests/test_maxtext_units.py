"""The MaxText integration's parts that need no MaxText: its keys and the
grain iterator's row in the snapshot."""

import json

import numpy as np
import pytest

from snapstore import Every
from snapstore.integrations.maxtext import (
    MaxTextConfigError,
    snapshot_options,
    split_snapshot_keys,
)
from snapstore.integrations.maxtext.train import (
    ITERATOR_ROW_BYTES,
    _iterator_rows,
    _set_iterator_state,
)


class FakeIterator:
  def __init__(self, state):
    self.state = state

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.state = state


class Loader:  # MaxText's MultiHostDataLoadIterator, as far as snapstore looks
  def __init__(self, state):
    self.local_iterator = FakeIterator(state)


@pytest.mark.parametrize("state", [b"\x00grain-bytes\xff", {"next_index": 17, "epoch": 2}])
def test_iterator_state_round_trips_through_its_row(state):
  rows = _iterator_rows(Loader(state))
  assert rows.shape == (1, ITERATOR_ROW_BYTES) and rows.dtype == np.uint8
  other = Loader(None)
  _set_iterator_state(other, rows)
  assert other.local_iterator.state == state


def test_a_row_written_by_another_process_is_refused():
  import jax
  rows = np.asarray(_iterator_rows(Loader({"i": 1}))).copy()
  rows[0, 1:5] = np.frombuffer((7).to_bytes(4, "little"), np.uint8)  # writer: process 7
  with pytest.raises(ValueError, match="state of process 7"):
    _set_iterator_state(Loader(None), jax.numpy.asarray(rows))


def test_an_oversized_iterator_state_is_an_error_not_a_truncation():
  with pytest.raises(ValueError, match="snapshots carry at most"):
    _iterator_rows(Loader(b"x" * ITERATOR_ROW_BYTES))


def test_a_host_without_data_round_trips_as_none():
  class Placeholder:
    pass
  rows = _iterator_rows(Placeholder())
  _set_iterator_state(Placeholder(), rows)  # nothing to set, and no error
  with pytest.raises(ValueError, match="does not match"):
    _set_iterator_state(Loader(json.dumps({})), rows)


def test_snapshot_keys_are_split_parsed_and_checked_by_name():
  rest, ours = split_snapshot_keys(["steps=5", "snapshot_interval=2", "snapshot_keep=3"])
  assert rest == ["steps=5"] and ours == {"snapshot_interval": 2, "snapshot_keep": 3}
  opts = snapshot_options({**ours, "run_name": "r"})
  assert (opts.interval, opts.keep, opts.run_id) == (Every(2), 3, "r")
  assert snapshot_options({"snapshot_interval": 0}) is None
  for bad, named in [({"snapshot_keep": 0}, "snapshot_keep=0"),
                     ({"snapshot_interval": 0, "snapshot_replicas": -1}, "snapshot_replicas=-1"),
                     ({"run_name": "a/b"}, "run_name='a/b'"),
                     ({"snapshot_intervall": 1}, "'snapshot_intervall'")]:
    with pytest.raises(MaxTextConfigError, match=named.replace("[", r"\[")):
      snapshot_options(bad)
  with pytest.raises(MaxTextConfigError, match="snapshot_store_dir"):
    split_snapshot_keys(["snapshot_store_dir=["])


def test_grain_with_maxtexts_elastic_training_is_refused_by_name():
  """The grain iterator's rows are laid out over every device, a lost
  slice's too: under MaxText's elastic retry the hook refuses grain, naming
  it, before MaxText's retry starts."""
  from types import SimpleNamespace

  from snapstore.integrations.maxtext.train import _Engine
  calls = []

  def original(config, callback_fn=None, pre_callback_fn=None):
    calls.append(config)
  with pytest.raises(MaxTextConfigError, match="dataset_type=grain with elastic_enabled"):
    _Engine({"snapshot_interval": 1}).elastic_retry(
        original, SimpleNamespace(dataset_type="grain"))
  assert calls == []
