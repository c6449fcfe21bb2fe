"""The demo's worker, but host ``$HANG_HOST`` stops in Python forever before
training step ``$HANG_STEP``: alive, its JAX heartbeats going on, never
joining the step's collectives, so the others wait inside them (gloo's own
timeout is 30 minutes). Only the supervisor's stall watch ends this job."""

import os
import time

from snapstore.demo import worker

_train = worker._Worker.train


def _train_or_hang(self, trainer, state, s):
  if self.host == int(os.environ["HANG_HOST"]) and s == int(os.environ["HANG_STEP"]):
    while True:
      time.sleep(3600)
  return _train(self, trainer, state, s)


worker._Worker.train = _train_or_hang

if __name__ == "__main__":
  raise SystemExit(worker.main())
