"""Going on with fewer hosts: the policy, the replica rings over uneven
domains, and the supervisor's arguments (the real jobs: test_multihost)."""

import pytest

from snapstore._placement import host_rings
from snapstore.recovery import MIN_HOSTS_ENV, REPLACEMENT_WAIT_ENV, ResizePolicy
from snapstore.testing import launch


@pytest.mark.parametrize("domains, replicas", [
    ({0: 0, 1: 0, 2: 1, 3: 1}, 1),        # even: the ring over domains
    ({0: 0, 1: 0, 3: 1}, 1),              # host 2 gone: 2 + 1
    ({0: 0, 1: 0, 3: 1, 4: 2, 5: 2}, 2),  # 2 + 1 + 2, two replicas
    ({1: 0, 2: 1, 3: 1, 4: 1}, 1),        # 1 + 3
    ({0: 0, 1: 1, 2: 2, 3: 3}, 3),
])
def test_every_host_reaches_as_many_other_domains_as_it_can(domains, replicas):
  rings = host_rings(domains, replicas)
  want = min(replicas, len(set(domains.values())) - 1)
  for ring in rings:  # each round is a permutation of the hosts (a device mesh)
    assert sorted(ring) == sorted(domains) and sorted(ring.values()) == sorted(domains)
  for h, k in domains.items():
    reached = {domains[ring[h]] for ring in rings} - {k}
    assert len(reached) >= want, (h, rings)


def test_one_domain_gets_no_ring():
  assert host_rings({0: 0, 1: 0}, 1) == []


def test_the_policy_comes_from_the_environment_unless_given(monkeypatch):
  monkeypatch.setenv(MIN_HOSTS_ENV, "3")
  monkeypatch.setenv(REPLACEMENT_WAIT_ENV, "2.5")
  assert ResizePolicy.from_env(None, None, hosts=4) == ResizePolicy(3, 2.5)
  assert ResizePolicy.from_env(2, 0.0, hosts=4) == ResizePolicy(2, 0.0)
  assert ResizePolicy.from_env(None, None, hosts=3).min_hosts is None  # never short
  monkeypatch.setenv(MIN_HOSTS_ENV, "three")
  with pytest.raises(ValueError, match=MIN_HOSTS_ENV):
    ResizePolicy.from_env(None, None, hosts=4)


@pytest.mark.parametrize("kw", [{"min_hosts": 0}, {"replacement_wait_s": -1.0},
                                {"replacement_wait_s": float("inf")}])
def test_a_bad_policy_is_refused(kw):
  with pytest.raises(ValueError):
    ResizePolicy(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"min_hosts": 3}, "in-place"),
    ({"min_hosts": 5, "in_place": True}, "between 1 and"),
    ({"replacement_delay_s": float("nan"), "in_place": True}, "finite"),
])
def test_launch_refuses_resize_arguments_it_cannot_honour(tmp_path, kw, match):
  with pytest.raises(ValueError, match=match):
    launch("snapstore.demo.worker", [], num_hosts=4, devices_per_host=1,
           store_dir=tmp_path, run_id="job", **kw)
