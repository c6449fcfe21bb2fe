"""Benchmark smoke tests at tiny sizes: JSON schema and finite, positive ratios;
and the goodput simulator checked against real runs of the rewind benchmark."""

import json
import math

import pytest

from benchmarks import (
  capture,
  checksum,
  cold,
  demo_overhead,
  device_check,
  first_saves,
  goodput,
  multihost,
  overhead,
  parity,
  resize,
  restore,
  rewind,
  scale,
  soak,
  vs_orbax,
  vs_orbax_snapshotter,
)

pytestmark = pytest.mark.slow  # real multi-process jobs: the full suite only


def _run(module, argv, out):
  assert module.main([*argv, "--out", str(out)]) == 0
  return json.loads(out.read_text())


def _positive(*values):
  for v in values:
    assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, v


def test_first_saves_benchmark_smoke(tmp_path):
  """Each save timed; the first slot's first use is counted (its drain), the
  next ones made ahead with a gap between saves."""
  result = _run(first_saves, ["--mb", "8", "--gaps", "0.2", "--warm", "2"],
                tmp_path / "first_saves.json")
  (row,) = result["runs"]
  assert len(row["save_s"]) == len(row["drain_s"]) == first_saves.KEEP + 1 + 2
  _positive(row["first_over_warm"], row["first_with_drain_over_warm"],
            row["first_touch_seconds"], row["ahead_seconds"])


def test_capture_benchmark_smoke(tmp_path, capsys):
  result = _run(capture, ["--mb", "8", "--repeats", "2", "--step-factor", "2",
                          "--many-leaves", "64"], tmp_path / "capture.json")
  assert result["benchmark"] == "capture"
  (row,) = result["sizes"]
  (many,) = result["many_leaves"]
  assert many["leaves"] == 64 and many["leaves"] > row["leaves"]
  _positive(*many["vs_few_leaves"].values())
  for r in (row, many):
    _positive(*r["floor"].values(), *r["over_floor"].values(), *r["jax_floor"].values(),
              r["checked_floor"]["seconds"], r["checked_floor"]["vs_memcpy"])
    assert r["checked_floor"]["threads"] in (1, 2)
  assert {"floor_save_s", "floor_restore_s"} <= set(many["vs_few_leaves"])
  bounds = {k: v for k, v in many["vs_few_leaves"].items() if k.startswith("jax_bound_")}
  assert len(bounds) == 3 and all(v >= 1.0 for v in bounds.values()), bounds
  _positive(*(row[k] for k in ("memcpy_gbps", "save_gbps", "save_vs_memcpy", "restore_gbps",
                               "restore_vs_memcpy", "step_s_plain", "step_s_snapshot")))
  assert math.isfinite(row["step_overhead"])
  assert json.loads(capsys.readouterr().out)["sizes"][0]["state_mb"] == row["state_mb"]


def test_device_check_runs_every_section_on_cpu_devices_bitwise(tmp_path):
  result = _run(device_check, ["--cpu", "--mb", "8", "--state-mb", "8", "--step-ms", "1",
                               "--steps", "2", "--rounds", "1", "--intervals", "1",
                               "--repeats", "1", "--stores", "pinned_device_sum",
                               "--per-step-steps", "2", "--staging", "ALWAYS",
                               "--per-step-stores", *device_check.PER_STEP,
                               "--rss-snapshots", "3"],
                tmp_path / "device_check.json")
  for kind in device_check.STORES:  # steps 0 and 1 each a slot's first use (keep=1), 2 warm
    row = result["stores"][kind]
    assert row["bitwise_equal"] and row["restored_step"] == 2
    assert len(row["first_saves_return_s"]) == 2
    _positive(*row["first_saves_return_s"], row["first_saves_vs_warm"])
  assert result["orbax"]["bitwise_equal"]
  _positive(result["capture"]["device_get_gbps"], result["capture"]["device_to_pinned_host_gbps"],
            result["overhead"]["pinned_device_sum"]["every_1"]["step_ms"])
  assert list(result["overhead"]) == ["state_mb", "iters", "steps_a_loop", "pinned_device_sum"]
  _positive(*(result["link"][f"{k}_{mb}mb_pieces_gbps"] for k in ("d2h", "h2d") for mb in (1, 4)))
  (row,) = result["per_step"].values()
  for name in device_check.PER_STEP:
    r = row[name]
    assert r["bitwise_equal"] and r["snapshots"] == 2 and r["rss_loop_snapshots"] == 3, r
    assert len(r["rss_loop_mb"]) == 2 and math.isfinite(r["rss_loop_growth_mb"]), r
    _positive(r["step_ms_none"], r["step_ms_every_1"], r["restore_s"], r["raw_h2d_s"],
              r["rss_mb_after"], r["small_budget_bound_ms"], *r["rss_loop_mb"])
  for name in ("host_files", "host_files_budget_64mb", "pinned_process",
               "pinned_process_budget_64mb"):  # --staging ALWAYS: staged on CPU
    assert row[name]["staged_bytes"] == 8 << 20, row[name]


def test_device_check_host_and_model_sections_on_cpu(tmp_path):
  result = _run(device_check, ["--cpu", "--sections", "host", "model", "per_step",
                               "--mb", "32", "--model", "32", "1", "64", "16", "8",
                               "--model-stores", "host_files", "pinned_device_sum",
                               "--host-mtbf-s", "3600", "--per-step-steps", "2",
                               "--rounds", "1", "--repeats", "1", "--layout", "transformer",
                               "--state-mb", "4", "--step-ms", "1",
                               "--per-step-stores", "pinned_device_sum"],
                tmp_path / "device_check.json")
  _positive(*(result["host"][f"copy_crc_{n}_threads_gbps"] for n in (1, 2, 4, 8)))
  model = result["model"]
  _positive(model["state_mb"])
  restored = 7  # (2 + 2 + 2 steps, then 1)
  for kind in ("host_files", "pinned_device_sum"):
    m = model[kind]
    assert m["bitwise_equal"] and m["restored_step"] == restored, m
    _positive(m["step_ms_none"], m["step_ms_every_1"], m["auto_step_ms"], m["auto_interval"])
    restored += 2 + 2 + 7  # the AutoInterval loops, then the next store's 2 + 4 + 1
  (row,) = result["per_step"].values()
  assert row["layout"] == "transformer" and row["leaves"] == 2 * 18, row  # 2 of 1.875 MiB
  assert row["pinned_device_sum"]["bitwise_equal"], row


def test_checksum_benchmark_smoke(tmp_path):
  result = _run(checksum, ["--mb", "4", "--repeats", "2"], tmp_path / "c.json")
  assert set(result["bytes_per_s"]) == {"memcpy", "host_crc32c", "device_sum"}
  _positive(*result["bytes_per_s"].values(), *result["ratio_to_memcpy"].values(),
            result["device_sum_over_host_crc32c_s"])


def test_overhead_benchmark_smoke(tmp_path):
  result = _run(overhead, ["--mb", "8", "--intervals", "1", "5", "--steps", "3",
                           "--rounds", "1", "--step-factor", "2"], tmp_path / "o.json")
  assert [r["interval"] for r in result["intervals"]] == [1, 5]
  _positive(result["step_s_none"], *(r["ratio"] for r in result["intervals"]))


def test_restore_benchmark_smoke(tmp_path):
  result = _run(restore, ["--mb", "4", "--repeats", "1"], tmp_path / "r.json")
  assert result["sources"] == {"ram": "snapshot", "orbax_local": "persistent",
                               "orbax_gcs": "persistent"}
  _positive(result["ram_s"], result["orbax_local_vs_ram"], result["orbax_gcs_vs_ram"])


def test_vs_orbax_benchmark_smoke(tmp_path):
  result = _run(vs_orbax, ["--mb", "4", "--repeats", "1"], tmp_path / "v.json")
  assert set(result["systems"]) == {"snapstore", "snapstore_host_files", "orbax_snapshotter",
                                    "orbax_local_ramfs"}
  assert len(result["ratios"]) == 9
  _positive(*result["ratios"].values())


def test_vs_orbax_snapshotter_benchmark_smoke(tmp_path):
  result = _run(vs_orbax_snapshotter, ["--mb", "4", "--repeats", "1"], tmp_path / "v.json")
  assert set(result["systems"]) == {"snapstore", "snapstore_host_files", "orbax_snapshotter"}
  assert len(result["ratios"]) == 6
  _positive(*result["ratios"].values())
  assert set(result["over_floor"]) == {"snapstore", "snapstore_host_files"}
  _positive(*result["floor"].values(),
            *[v for row in result["over_floor"].values() for v in row.values()])


@pytest.mark.parametrize("scenario", ["vs_orbax", "elastic"])
def test_cold_benchmark_times_each_system_in_a_fresh_process(tmp_path, scenario):
  result = _run(cold, ["--mb", "4", "--runs", "1", "--leaves", "0", "--warm", "1",
                       "--scenario", scenario], tmp_path / "c.json")
  (row,) = result["by_leaves"].values()
  assert set(row["systems"]) == {"snapstore", "snapstore_host_files", "orbax_snapshotter"}
  assert set(row["over_orbax"]) == {"snapstore", "snapstore_host_files"}
  if scenario == "elastic":  # every phase of Orbax's benchmark, cold and warm
    assert set(row["over_orbax"]["snapstore"]) == {
        f"{r}_{p}_s" for r in ("cold", "warm") for p in cold.ELASTIC_PHASES}
  _positive(*[v for m in row["systems"].values() for v in m.values()],
            *[v for m in row["over_orbax"].values() for v in m.values()])


def test_multihost_benchmark_smoke(tmp_path):
  result = _run(multihost, ["--mb", "8", "--steps", "2", "--rounds", "1", "--repeats", "1",
                           "--step-s", "0.05"],
                tmp_path / "m.json")
  assert result["hosts"] == 4
  _positive(result["step_ratio"], result["orbax_local_vs_ram"], result["orbax_gcs_vs_ram"],
            result["orbax_local_vs_ram_first"], result["orbax_gcs_vs_ram_first"],
            result["restore_ram_first_s"], result["replica_bytes_per_step"])


def test_resize_benchmark_goes_on_short_and_grows_back_without_a_lost_step(tmp_path):
  """No spare host for 15 s: GCS-only restarts from its checkpoint after
  the wait; the resize run restores the lost host's pieces onto 6 devices,
  trains there, and grows back to 8 restoring its own last step."""
  result = _run(resize, ["--runs", "gcs-only", "snapstore-resize", "--kill-step", "7",
                         "--checkpoint-every", "3", "--step-s", "0.2", "--delay", "15",
                         "--steps", "45"],
                tmp_path / "r.json")
  gcs, short = result["runs"]["gcs-only"], result["runs"]["snapstore-resize"]
  assert gcs["source"] == "persistent" and gcs["restored_step"] in (3, 6)  # (6: committed)
  assert gcs["steps_lost"] == 7 - gcs["restored_step"]
  assert gcs["first_step_after_kill_s"] >= 15  # it waited for the capacity
  assert [(r["devices"], r["source"]) for r in short["restores"]] == [
      (6, "snapshot"), (8, "snapshot")], short["restores"]
  assert short["restores"][1]["rewind_steps"] == 0 and short["steps_while_short"] >= 1
  assert result["final_loss_rel_diff"] < 1e-5
  _positive(*(r[k] for r in (gcs, short) for k in ("time_lost_s", "full_size_after_kill_s")),
            short["throughput_while_short"], result["time_lost_vs_gcs_only"]["snapstore-resize"])


def test_parity_benchmark_keeps_a_third_of_the_replica_bytes_and_restores_bitwise(tmp_path):
  """Measured from the 4 hosts' stores: parity k=3 keeps <= 0.4x the extra
  bytes of replicas=1; a wiped host is restored at the newest step, bitwise,
  from replicas and from a parity rebuild."""
  result = _run(parity, ["--mb", "8", "--steps", "2", "--rounds", "1", "--repeats", "1",
                         "--step-s", "0.05"], tmp_path / "p.json")
  assert 0 < result["extra_parity_vs_replica"] <= 0.4
  for mode in ("replica", "parity"):
    r = result[mode]
    assert r["bitwise_equal"] and r["restored_step"] == r["newest_step"], (mode, r)
    _positive(r["ram_bytes_per_host_max"], r["bytes_moved_per_snapshot"],
              r["restore_lost_host_s"])
  assert result["parity"]["bytes_rebuilt"] > 0 and result["replica"]["bytes_rebuilt"] == 0
  _positive(result["encode_sum_s"], result["encode_xor_vs_sum"])
  assert result["parity"]["ram_bytes_per_host_max"] < result["replica"]["ram_bytes_per_host_max"]
  plans = {p["option"]: p for p in result["v5p_capacity"]["options"]}
  assert plans["parity k=3"]["extra"] * 3 == pytest.approx(plans["replicas=1"]["extra"], rel=1e-6)


def test_scale_benchmark_one_host_lost_only_its_replacement_receives_its_share(tmp_path):
  out = scale.main(["--sizes", "8", "16", "--cases", "none", "one", "two",
                    "--redundancy", "replicas", "--out", str(tmp_path / "s.json")])
  rows = {(r["n"], r["case"]): r for r in out["rows"]}
  for n in (8, 16):
    assert rows[(n, "none")]["verdict"] == "snapshot"
    assert set(rows[(n, "none")]["state_received"].values()) == {0}
    one = rows[(n, "one")]
    assert one["verdict"] == "snapshot"
    got = one["state_received"]
    lost = n // 2
    # its share, less the replicated leaves counted once a device in the share
    assert 0 < one["state_share_bytes"] - got[lost] < 4096, (got, one["state_share_bytes"])
    assert all(v == 0 for h, v in got.items() if h != lost)
    assert rows[(n, "two")]["verdict"] == "persistent"  # a host and its keeper lost
    assert rows[(n, "one")]["payload_received_max"] < 1 << 20


def test_goodput_presets_and_curves(tmp_path):
  result = _run(goodput, ["--curves", str(tmp_path / "curves")], tmp_path / "g.json")
  assert {p["preset"] for p in result["presets"]} == set(goodput.PRESETS)
  for preset in result["presets"]:
    by = {s["strategy"]: s for s in preset["strategies"]}
    assert set(by) == {"gcs-only", "emergency-local", "snapstore"}
    for s in by.values():
      assert 0 < s["goodput"] <= 1
    # Per-step snapshots rewind less than checkpoints every 100 steps.
    assert by["snapstore"]["rewind_steps"] < by["gcs-only"]["rewind_steps"]
    # the restore decision, measured at the preset's host count, is in its recovery
    assert 0 < preset["snapstore_restore_metadata_s"] < by["snapstore"]["recovery_s"]
  assert len(result["curves"]) == 2 * len(goodput.PRESETS)
  assert all((tmp_path / "curves" / p.split("/")[-1]).stat().st_size > 0
             for p in result["curves"])


def test_mean_rewind_model_limits():
  # A save every step, committed instantly, failures uniform in time: nothing lost.
  assert goodput.mean_rewind(1, 0.0, 1.0) == pytest.approx(0.0, abs=1e-3)
  # Every 10 steps, instant commit: the lost steps average 4.5.
  assert goodput.mean_rewind(10, 0.0, 1.0) == pytest.approx(4.5, abs=0.01)
  # A commit lag of 3 steps adds 3 steps.
  assert goodput.mean_rewind(10, 3.0, 1.0) == pytest.approx(7.5, abs=0.01)


def test_simulator_predicts_the_rewind_of_real_runs(tmp_path):
  """The small case: checkpoint every 10 steps, 8 SIGKILLs (stratified over
  the checkpoint period) without snapshots, the first 3 of them with
  snapshots, real processes. The GCS-only mean rewind must be predicted
  within 20%; with snapshots every rewind is 0 or 1 step, from RAM."""
  # 0.2 s steps: a checkpoint's commit (~0.1 s here) stays within one step
  # even when the machine is busy, as in real training.
  measured = _run(rewind, ["--intervals", "10", "--kills", "8", "--kills-with", "3",
                           "--seed", "0", "--step-s", "0.2"], tmp_path / "rewind.json")
  (case,) = measured["cases"]
  assert case["with"]["max"] <= 1 and case["with"]["sources"] == ["snapshot"] * 3
  assert case["without"]["sources"] == ["persistent"] * 8
  rows = {r["snapshots"]: r for r in goodput.check(measured)["rows"]}
  assert rows[False]["relative_error"] <= 0.20, rows[False]
  # With snapshots the model's mean is not tested: whether a kill lands
  # before or after its step's ~8 ms snapshot commit is timing, and the model
  # itself gives all three kills the 1-step outcome about 6% of the time
  # (CI saw it). Each prediction still lies in the 0-1 step range measured.
  assert all(0.0 <= p <= 1.0 for p in rows[True]["predicted"]), rows[True]


def test_soak_benchmark_recovers_every_kill_bitwise(tmp_path):
  """Two seeded kills (one mid-snapshot, one with the store wiped): every
  completed restore is bitwise equal to the uninterrupted run, from RAM."""
  result = _run(soak, ["--kills", "2", "--seed", "3"], tmp_path / "s.json")
  assert len(result["kill_schedule"]) == 2
  assert result["restores_completed"] >= 1
  assert result["fraction_correct"] == 1.0 and result["partial_restores"] == 0
  assert result["final_state_equal"]


def test_in_place_soak_recovers_a_hang_and_a_wipe_each_hit_again_in_recovery(tmp_path):
  """In place on 4 hosts: a host frozen (SIGSTOP), then one killed with its
  store wiped, each replacement killed again inside the restore that heals
  it. Four heals exceed what gloo's communicators allow one incarnation on
  CPU, so one fault ends in a full restart: every digest around each fault
  is bitwise the uninterrupted run's, the hung host was fenced, and each
  fault's time lost is measured."""
  result = _run(soak, ["--in-place", "--kills", "2", "--faults", "stop,wipe",
                       "--second-fault", "1", "--seed", "1"], tmp_path / "s.json")
  rows = result["per_fault"]
  assert [(r["kind"], r["second_fault"]) for r in rows] == [("stop", True), ("wipe", True)]
  assert all(r["bitwise"] for r in rows) and result["final_state_equal"], rows
  # the frozen host was fenced; a host fenced besides is one a fault hit (a replacement
  # killed in its restore can be reported missing while its successor starts), never
  # a healthy survivor
  stopped = {r["host"] for r in rows if r["kind"] == "stop"}
  assert stopped <= set(result["fenced_hosts"]) <= {r["host"] for r in rows}, result
  assert result["replacements"] >= 2 and result["in_place"] >= 1, result
  assert result["full_restarts"] >= 1, result  # (four heals: past gloo's cap on CPU)
  assert all(math.isfinite(r["lost_s"]) for r in rows), rows


def test_demo_overhead_benchmark_smoke(tmp_path):
  result = _run(demo_overhead, ["--steps", "8", "--step-s", "0.1", "--replica-intervals", "2"],
                tmp_path / "d.json")
  _positive(result["snapshots_off"]["median_step_s"],
            result["replica_interval"]["2"]["median_step_s"])
  assert math.isfinite(result["replica_interval"]["2"]["overhead_mean"])


def test_restore_layouts_benchmark_smoke(tmp_path):
  """Every store restores every layout bitwise (CPU devices, sizes / 64)."""
  from benchmarks import restore_layouts
  result = restore_layouts.main(["--cpu", "--repeats", "1", "--out", str(tmp_path / "r.json")])
  for layout in restore_layouts.LAYOUTS:
    row = result[layout]
    for store in restore_layouts.STORES:
      assert row[store]["bitwise_equal"], (layout, store)
      _positive(row[store]["restore_s"], row["raw_put_s"])
