"""Ending a gloo collective stuck on a dead or frozen peer (snapstore.recovery.watchdog)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from snapstore import recovery
from snapstore.recovery import watchdog


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
  server = socket.create_server(("127.0.0.1", 0))
  client = socket.create_connection(server.getsockname())
  accepted, _ = server.accept()
  return server, client, accepted


def test_shut_down_ends_a_blocked_read_on_the_matching_sockets_only():
  server, client, accepted = _pair()
  other_server, other_client, other_accepted = _pair()
  port = server.getsockname()[1]
  assert port in watchdog.listening_ports()
  got: list[bytes] = []
  reader = threading.Thread(target=lambda: got.append(client.recv(10)))
  reader.start()
  time.sleep(0.2)
  assert reader.is_alive()  # blocked: nothing was sent
  assert watchdog.shut_down({port}, set()) == 1  # the accepted end only
  reader.join(10)
  assert not reader.is_alive() and got == [b""]  # EOF, as gloo sees it
  other_accepted.sendall(b"ok")  # the other pair is untouched
  assert other_client.recv(10) == b"ok"
  for s in (server, client, accepted, other_server, other_client, other_accepted):
    s.close()


def test_shut_down_by_peer_port_takes_the_connecting_end():
  server, client, accepted = _pair()
  assert watchdog.shut_down(set(), {server.getsockname()[1]}) == 1
  assert accepted.recv(10) == b""
  for s in (server, client, accepted):
    s.close()


@pytest.fixture
def service():
  from jax._src.lib import _jax
  port = socket.create_server(("127.0.0.1", 0))
  address = f"127.0.0.1:{port.getsockname()[1]}"
  port.close()
  svc = recovery.start_service(address, 1)
  client = _jax.get_distributed_runtime_client(address, 0, init_timeout=30,
                                               heartbeat_timeout=10)
  client.connect()
  yield client
  client.shutdown()
  svc.shutdown()


def _beat(client, peer: int, *, age_s: float, process: str = "p") -> None:
  client.key_value_set(f"{watchdog.BEATS}/{peer}",
                       json.dumps({"t": time.time() - age_s, "ports": [], "process": process}),
                       allow_overwrite=True)


@pytest.mark.parametrize("peer", ["silent", "replaced", "fresh", "not stuck"])
def test_the_watchdog_aborts_only_when_stuck_and_a_peer_is_gone(service, peer):
  block = [time.monotonic()]
  dog = watchdog.Watchdog(service, 0, 2, after_s=1.0, in_block=lambda: block[0], gloo_ports=set())
  _beat(service, 1, age_s=0.0, process="first")
  dog.check()  # the block begins: process 1 is "first"
  time.sleep(1.1)  # stuck in that block for longer than after_s
  if peer == "not stuck":
    block[0] = time.monotonic()  # no: a new block just began
  _beat(service, 1, age_s=3.0 if peer == "silent" else 0.0,
        process="second" if peer == "replaced" else "first")
  dog.check()
  if peer == "silent":  # old by its clock; it must also stay unchanged here a while
    assert dog.aborts == []
    time.sleep(0.6)
    dog.check()
  fired = [a["why"] for a in dog.aborts]
  if peer in ("fresh", "not stuck"):
    assert fired == []
  else:
    assert len(fired) == 1 and ("replaced" in fired[0]) == (peer == "replaced")
    dog.check()
    assert len(dog.aborts) == 1  # once per block


def test_a_peer_that_never_beat_counts_from_the_watchdogs_start(service):
  since = time.monotonic() - 5.0
  dog = watchdog.Watchdog(service, 0, 2, after_s=1.0, in_block=lambda: since, gloo_ports=set())
  dog.check()  # the block's first check records who is in it
  dog.check()
  assert dog.aborts == []  # started just now: process 1 may not have begun
  dog._started -= 2.0
  dog._started_mono -= 2.0
  dog.check()
  assert len(dog.aborts) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_collective_stuck_on_a_frozen_peer_fails_without_the_collective_timeout(tmp_path):
  port = socket.create_server(("127.0.0.1", 0))
  address = f"127.0.0.1:{port.getsockname()[1]}"
  port.close()
  out = tmp_path / "host0.json"
  procs = []
  for pid in (0, 1):
    env = dict(os.environ, SNAPSTORE_HOST=str(pid), SNAPSTORE_COORDINATOR=address)
    procs.append(subprocess.Popen([sys.executable, "-m", "tests._stall_worker", str(out)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
  try:
    procs[0].wait(timeout=120)  # the collective timeout is 600 s
  finally:
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    if procs[0].poll() is None:
      procs[0].kill()
  got = json.loads(out.read_text())
  assert got["first"] == 512.0
  assert "result" not in got, got
  assert len(got["aborts"]) == 1 and got["aborts"][0]["sockets"] >= 1, got
  assert "'1'" in got["aborts"][0]["why"]
  assert got["gloo_ports"]


def test_a_replaced_peer_is_acted_on_before_after_s_a_silent_one_is_not(service):
  block = [time.monotonic()]
  dog = watchdog.Watchdog(service, 0, 3, after_s=30.0, in_block=lambda: block[0],
                        gloo_ports=set())
  assert dog.replaced_after_s == 2 * dog.period_s
  _beat(service, 1, age_s=0.0, process="one")
  _beat(service, 2, age_s=0.0, process="two")
  dog.check()  # the block begins
  time.sleep(dog.replaced_after_s + 0.1)
  _beat(service, 2, age_s=20.0, process="two")  # silent, but not for after_s
  dog.check()
  assert dog.aborts == []
  _beat(service, 1, age_s=0.0, process="one again")  # its replacement beats
  dog.check()
  assert len(dog.aborts) == 1 and "'1': 'replaced'" in dog.aborts[0]["why"]
  assert "'2'" not in dog.aborts[0]["why"]
