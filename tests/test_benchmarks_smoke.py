"""The benchmark scripts keep working: each runs at tiny sizes under torchrun (and checks its own
numerics, exiting non-zero on a mismatch), writing its record to a temporary directory. Timings at
these sizes mean nothing and are not read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.multiproc import SUBPROCESS_DEADLINE_S, run_ranks

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "script,ranks",
    # (the seed scenario and the collectives comparison are documented at 4 ranks; 2 prove the scripts run)
    # (the longest in the slow tier, their systems the tests' compiles again at smoke sizes: suite.py and
    # bench_train.py, 26 s and 20 s, the numerics' and the training tests'; bench_decode.py and
    # bench_memory.py, 24 s and 21 s under a load of 4, test_serving.py's decoding and the bytes a compile
    # frees, test_held_bytes.py and test_process_state.py)
    [("bench_seed.py", 2), pytest.param("bench_memory.py", 2, marks=pytest.mark.slow), ("bench_collectives.py", 2),
     pytest.param("suite.py", 2, marks=pytest.mark.slow), ("bench_overlap.py", 2), ("bench_fused_kv.py", 2),
     ("bench_call_check.py", 2), pytest.param("bench_train.py", 2, marks=pytest.mark.slow),
     pytest.param("bench_decode.py", 2, marks=pytest.mark.slow),
     # (tests/test_quantized.py checks the int8 cut on real ranks; this one decodes with a KV cache: ~70 s loaded)
     pytest.param("bench_quantized.py", 2, marks=pytest.mark.slow),
     # (test_activation_checkpointing.py counts what the backward keeps, at smaller sizes)
     pytest.param("bench_checkpointing.py", 2, marks=pytest.mark.slow),
     # (tests/test_training_2d.py trains and counts the same 2x2 composition)
     pytest.param("bench_fsdp2.py", 4, marks=pytest.mark.slow),
     # (tests/test_lora.py trains the same PEFT LoRA against its twin)
     pytest.param("bench_lora.py", 2, marks=pytest.mark.slow),
     # (tests/test_regional.py checks the same three modes' numerics and held bytes)
     pytest.param("bench_regional.py", 2, marks=pytest.mark.slow)],
)
def test_benchmark_smoke(script, ranks, tmp_path):
    """Each script's ``main()`` with ``--smoke`` on the test harness's gloo ranks (forked from a
    server that has imported torch: a torchrun launch per script cost about 3 s more each)."""
    out = tmp_path / "result.json"
    run_ranks(_main, ranks, script.removesuffix(".py"), str(out), timeout=SUBPROCESS_DEADLINE_S)
    record = json.loads(out.read_text())
    assert record["world_size"] == ranks and record["torch"].startswith("2.13") and record["results"]


def _main(rank: int, world: int, module: str, out: str) -> None:
    """``python -m benchmarks.<module> --smoke --out OUT`` on this rank (the group is the harness's)."""
    import importlib

    sys.argv = [module, "--smoke", "--out", out]
    importlib.import_module(f"benchmarks.{module}").main()


@pytest.mark.slow  # 29 s: two torchrun launches; tests/test_parallelize.py loads every format on the harness's ranks
def test_bench_load_smoke(tmp_path):
    """bench_load.py is a driver: it writes the checkpoints, then launches one torchrun of 2 ranks per
    loading path (a fresh process each, for its peak RSS). The smoke run takes one, at a tiny size:
    parallelize from safetensors (each torchrun costs ~10 s here; the other dynashard paths differ only
    in the checkpoint they name, and tests/test_parallelize.py loads every format)."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_load", "--smoke", "--paths", "safetensors",
           "--dir", str(tmp_path / "checkpoints"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_DEADLINE_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"safetensors"}, record["results"]
    assert all(r["peak_rss_mib"] > 0 and r["max_abs_diff"] < 1e-3 for r in record["results"].values()), record


@pytest.mark.slow  # ~85 s: three torchrun launches (cold, warm, the profiled warm); HF's TP systems left out
def test_bench_start_smoke(tmp_path):
    """bench_start.py is a driver: a fresh torchrun per system. The smoke run takes dynashard's cold and warm
    starts on a tiny checkpoint: the warm one must hit the Inductor cache the cold one filled (its
    ``TORCH_LOGS=dynashard`` lines say so), and the profiled warm run must find dynashard's backend."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_start", "--smoke", "--systems", "ds_cold,ds_warm",
           "--dir", str(tmp_path / "checkpoint"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_DEADLINE_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    cold, warm = results["ds_cold"]["runs"][0], results["ds_warm"]["runs"][0]
    assert all(r["max_abs_diff"] < 1e-3 and r["t_first_s"] > 0 for r in (cold, warm)), results
    assert any("Inductor cache: 1 miss" in line for line in cold["dynashard_log"]), cold["dynashard_log"]
    assert any("Inductor cache: 1 hit" in line for line in warm["dynashard_log"]), warm["dynashard_log"]
    assert results["ds_warm_profiled"]["profile_rank0_cumulative_s"]["dynashard backend"] > 0, results


@pytest.mark.slow  # ~10 s: one process (imports, one compile on the fake group)
def test_bench_compile_phases_smoke(tmp_path):
    """bench_compile_phases.py times dynashard's phases by wrapping its functions: each must have been reached
    (a renamed function would otherwise read as a phase that costs nothing), and inside the first call."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_compile_phases", "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_DEADLINE_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    phases = ("backend", "aten trace", "plan", "rewrite")
    assert all(row[p] > 0 for p in phases) and "graph compile" in row, row
    assert row["aten trace"] + row["plan"] + row["rewrite"] <= row["backend"] < row["first call"], row
    assert row["aten ops"] > 0 and 0 < row["fake run"] and 0 < row["make_fx run"], row
    assert row["gc mode"] == "default" and 0 <= row["gc"] < row["first call"], row  # (a round may not collect)


@pytest.mark.slow  # ~30 s: five processes, each importing torch and compiling or loading one graph
def test_bench_inductor_load_smoke(tmp_path):
    """bench_inductor_load.py's processes each report what the table reads: the first call in every variant, and
    the probe and the hash on their own where they are split off."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_inductor_load", "--layers", "1", "--repeats", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_DEADLINE_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]["1"]
    assert set(runs) == {"plain", "split", "isa_ok"} and all(len(r) == 1 for r in runs.values()), runs
    assert all(r[0]["first call"] > 0 for r in runs.values()), runs
    assert runs["split"][0]["pick_vec_isa"] > 0 and runs["split"][0]["torch_key"] > 0, runs
    assert "| 1 | " in done.stdout, done.stdout
