"""What :func:`.supervisor.launch` was asked to run, checked, for each
incarnation: the job's arguments, where each host's store lives (its
machine's directory), and the port its coordinator binds."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from .._backends import host_dir
from .kills import Kill
from .stall import StallWatch


def reserve_port(host: str) -> socket.socket:
  """A bound (not listening) socket on a free port of ``host``, held while
  the job starts so no other program takes the port; ``SO_REUSEPORT`` lets
  the coordination service (gRPC sets it too) bind the same port."""
  s = socket.socket()
  s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  s.bind((host, 0))
  return s


def placements(machines: Sequence[Sequence[int]] | None, num_hosts: int,
               in_place: bool) -> list[list[int]] | None:
  """``launch``'s ``machines``, checked: each a list of distinct machines,
  one a host."""
  if machines is None:
    return None
  if in_place:
    raise ValueError("machines is for full restarts (a replacement in place keeps its host)")
  out = [[int(m) for m in row] for row in machines]
  for row in out:
    if len(row) < num_hosts or len(set(row)) != len(row) or min(row) < 0:
      raise ValueError(f"each entry of machines must name {num_hosts} distinct machines "
                       f"(>= 0), one a host; got {row}")
  if not out:
    raise ValueError("machines must have at least one entry")
  return out


def check_args(num_hosts: int, in_place: bool, min_hosts: int | None,
               **delays: float) -> None:
  if min_hosts is not None and not in_place:
    raise ValueError("min_hosts is for in-place jobs (in_place=True)")
  if min_hosts is not None and not 1 <= min_hosts <= num_hosts:
    raise ValueError(f"min_hosts must be between 1 and num_hosts ({num_hosts}), "
                     f"got {min_hosts}")
  for name, value in delays.items():
    if not 0.0 <= value < float("inf"):
      raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclasses.dataclass
class Job:
  """What :func:`launch` was asked to run, for each incarnation."""

  module: str
  args: list[str]
  devices_per_host: int
  store_dir: str | os.PathLike[str]
  run_id: str
  kills: list[Kill]
  carried: list[Kill]  # kills for any incarnation, not fired yet
  deadline: float  # time.monotonic()
  timeout_s: float
  report_dir: Path
  log_dir: Path
  env: dict[str, str]
  bind_address: str
  in_place: bool
  host_service: bool
  max_replacements: int
  min_hosts: int | None
  replacement_delay_s: float
  teardown_delay_s: float
  watch: StallWatch  # the job's progress and step time, across incarnations
  machines: list[list[int]] | None = None  # per incarnation: host -> its machine

  def machine_dir(self, number: int, host: int) -> Path:
    """Where host ``host`` of incarnation ``number`` keeps its store: its
    machine's directory (``machines``), else the job's one store directory."""
    if self.machines is None:
      return Path(self.store_dir)
    placement = self.machines[min(number, len(self.machines) - 1)]
    return Path(self.store_dir) / f"machine-{placement[host]}"

  def store_of(self, number: int, host: int) -> Path:
    """Host ``host``'s own store in incarnation ``number``."""
    return host_dir(self.machine_dir(number, host), self.run_id, host)

  def lost_with(self, number: int, host: int) -> Path | None:
    """What a kill with ``lose_store`` wipes beside the host's store: its
    whole machine, where hosts have machines (None: its store only)."""
    return self.machine_dir(number, host) if self.machines is not None else None
