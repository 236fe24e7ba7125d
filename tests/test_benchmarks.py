"""The kernel benchmarks on a machine without CUDA: each exits with one clear line, and
run_all reports that line and reads tables back from the CSVs a script wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(
    "name", ["bench_decode", "bench_extend", "bench_scatter", "bench_generate_batch"]
)
def test_without_cuda_one_clear_line(name):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py")],
        capture_output=True,
        text=True,
        env=NO_GPU,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{name}: needs a CUDA GPU, and torch {torch_version()} sees none"
    ]


def torch_version() -> str:
    import torch

    return torch.__version__


def test_run_all_reports_each_failure(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--only", "decode,scatter"],
        capture_output=True,
        text=True,
        env={**NO_GPU, "OUT": str(tmp_path)},
        timeout=600,
    )
    assert result.returncode == 1
    summary = result.stdout.split("=== summary")[1]
    for name in ("bench_decode", "bench_scatter"):
        assert f"## {name}: exit 1" in summary
        assert f"{name}: needs a CUDA GPU" in summary


def test_run_all_reads_the_main_table_from_its_csv(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCHMARKS))
    since = time.time() - 1
    assert run_all.tables_written("scatter", tmp_path, since) == "(no table written)"
    (tmp_path / "scatter_d64.csv").write_text("tokens,nanoserve\n32,12.5\n")
    assert run_all.tables_written("scatter", tmp_path, since) == "tables: scatter_d64.csv"
    (tmp_path / "scatter.csv").write_text("shape,provider,graph_us\n32tok,nanoserve,1.5\n")
    assert run_all.tables_written("scatter", tmp_path, since) == (
        "| shape | provider | graph_us |\n|---|---|---|\n| 32tok | nanoserve | 1.5 |"
    )
    os.utime(tmp_path / "scatter.csv", (since - 60, since - 60))  # an older run's table
    assert run_all.tables_written("scatter", tmp_path, since) == "tables: scatter_d64.csv"
