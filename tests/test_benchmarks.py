"""Benchmark smoke tests at tiny sizes: JSON schema and finite, positive ratios."""

import json
import math

from benchmarks import capture


def test_capture_benchmark_smoke(tmp_path, capsys):
  out = tmp_path / "capture.json"
  assert capture.main(["--mb", "8", "--repeats", "2", "--step-factor", "2",
                       "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["benchmark"] == "capture"
  (row,) = result["sizes"]
  for key in ("memcpy_gbps", "save_gbps", "save_vs_memcpy", "restore_gbps",
              "restore_vs_memcpy", "step_s_plain", "step_s_snapshot"):
    assert math.isfinite(row[key]) and row[key] > 0, key
  assert math.isfinite(row["step_overhead"])
  assert json.loads(capsys.readouterr().out)["sizes"][0]["state_mb"] == row["state_mb"]
