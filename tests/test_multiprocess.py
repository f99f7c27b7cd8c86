"""Two CPU processes under ``jax.distributed``: the skip is global and checkpoints round-trip.

Each process runs ``multiprocess_worker.py`` (a data-parallel ``loss_scaling`` step over a mesh
of both processes' devices, an inf in one process's rows, an Orbax save and restore of the whole
training state) and writes what it saw; this test compares the processes.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
ROOT = WORKER.parents[1]
PROCESSES = 2
LOCAL_DEVICES = 2  # per process: collectives within and across processes
TIMEOUT_S = 180
CANNOT_RUN = 77  # multiprocess_worker.CANNOT_RUN


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_processes(workdir: pathlib.Path) -> list[dict]:
  port = _free_port()
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  logs = [workdir / f"log_{i}.txt" for i in range(PROCESSES)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as out:
      args = [str(i), str(PROCESSES), str(port), str(LOCAL_DEVICES), str(workdir)]
      procs.append(
        subprocess.Popen(
          [sys.executable, str(WORKER), *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
      )
  codes = []
  try:
    for p in procs:
      codes.append(p.wait(timeout=TIMEOUT_S))
  except subprocess.TimeoutExpired:
    codes = None
  finally:
    for p in procs:  # a process left waiting on its peer
      if p.poll() is None:
        p.kill()
        p.wait()

  def report() -> str:
    return "\n".join(
      f"--- process {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs)
    )

  if codes is None:
    pytest.fail(f"the processes did not finish in {TIMEOUT_S} s\n{report()}")
  if CANNOT_RUN in codes:
    pytest.skip(f"jax.distributed cannot run on CPU here: {report()}")
  assert codes == [0] * PROCESSES, f"exit codes {codes}\n{report()}"
  return [json.loads((workdir / f"result_{i}.json").read_text()) for i in range(PROCESSES)]


def test_two_processes_skip_and_halve_identically_and_checkpoints_are_bit_exact(tmp_path):
  results = _run_processes(tmp_path)
  first, last = results[0], results[-1]
  assert first["devices"] == PROCESSES * LOCAL_DEVICES
  # The inf is in the last process's rows only: the others saw finite data and still skip.
  assert first["local_rows_finite"] and not last["local_rows_finite"]
  for r in results:
    assert r["first_finite"] and r["first_scale"] == 2.0**10, r
    assert r["first_matches_reference"], r  # the global step is the one-device step
    assert not r["skip_finite"] and r["skip_scale"] == 2.0**9 and r["skipped_steps"] == 1, r
    assert r["skip_changed"] == [], r
    assert r["restored_all_on_mesh"] and r["restored_differences"] == [], r
    assert r["resumed_differences"] == [], r
  # Replicated state: every process holds the same bits, before and after the round trip.
  assert len({r["state_digest"] for r in results}) == 1
  assert len({r["resumed_digest"] for r in results}) == 1
