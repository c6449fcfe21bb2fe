"""The agreed device order after a heal (snapstore._group): every device
group that holds a replacement's device is new; every process draws the same."""

import dataclasses

import pytest

from snapstore import _group


@dataclasses.dataclass(frozen=True)
class Dev:  # what rekeyed reads of a jax.Device
  id: int


def test_cliques_are_the_groups_of_every_reshape():
  c = _group.cliques([0, 1, 2, 3])
  assert {(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)} <= c
  assert (1, 0) not in c and (0, 3) not in c


@pytest.mark.parametrize("hosts,per_host", [(4, 2), (3, 2), (8, 1)])
def test_rekeyed_order_has_only_new_groups_with_a_replacement(hosts, per_host):
  devices = [Dev(h * 2048 + j) for h in range(hosts) for j in range(per_host)]
  used = _group.cliques([d.id for d in devices])  # the default order, used so far
  replaced = {d.id for d in devices[per_host:2 * per_host]}  # host 1 rejoined
  live = {d: (7 if d.id in replaced else 1) for d in devices}
  order = _group.rekeyed(live, used, replaced)
  assert order is not None and sorted(order, key=lambda d: d.id) == devices
  fresh = [c for c in _group.cliques([d.id for d in order]) if replaced & set(c)]
  assert fresh and not any(c in used for c in fresh)
  assert _group.rekeyed(dict(reversed(list(live.items()))), used, replaced) == order
  other = _group.rekeyed({d: i + 9 for d, i in live.items()}, used, replaced)
  assert other != order  # another incarnation, another draw


def test_no_order_left_is_none():
  devices = [Dev(0), Dev(1)]
  used = {(0, 1), (1, 0)}
  assert _group.rekeyed({d: 1 for d in devices}, used, {1}) is None
