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
    "name",
    [
        "bench_decode",
        "bench_extend",
        "bench_scatter",
        "bench_generate_batch",
        "bench_content_hash",
        "bench_decode_splits",
        "bench_gated_act",
        "bench_sampling",
        "bench_prefill",
        "profile_eos_spread",
    ],
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


def import_benchmark_module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_reference_survives_its_device_tensor_being_overwritten():
    import torch

    harness = import_benchmark_module("harness")
    query = torch.randn(3, 4, 8)
    ref_on_device = query * 2  # stands in for a reference whose memory is later reused
    reference = harness.Reference(ref_on_device, {"q": query})
    out = torch.full((5, 4, 8), float("nan"))
    out[:3] = query * 2
    out[3:] = torch.randn(2, 4, 8)  # rows past the reference's are not compared
    ref_on_device.zero_()
    assert float(reference.err(out)) < 1e-15


def test_reference_names_inputs_overwritten_after_it():
    import torch

    harness = import_benchmark_module("harness")
    query, pool = torch.randn(3, 4, 8), torch.randn(6, 2, 8).to(torch.bfloat16)
    table = torch.randperm(6, dtype=torch.int32).view(3, 2)
    inputs = {"q": query, "kc": pool, "bt": table}
    reference = harness.Reference(query.clone(), inputs)
    assert reference.changed() == []
    assert float(reference.err(query)) == 0.0
    query[1, 2, 3] += 1.0
    assert reference.err(query) == "inputs changed: q"
    table[2, 1] = table[0, 0]  # a table row pointing at another's block
    assert reference.changed() == ["q", "bt"]


def test_run_all_collects_main_table_and_zips_the_rest(tmp_path):
    import zipfile

    run_all = import_benchmark_module("run_all")
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir(), out.mkdir()
    since = time.time() - 1
    (scratch / "extend.csv").write_text("shape,provider\nd128 1x512,nanoserve\n")
    (scratch / "extend.png").write_bytes(b"png")
    (scratch / "extend_d128_b1.csv").write_text("new,nanoserve\n512,1.0\n")
    run_all.collect("extend", scratch, out, since)
    for path in scratch.iterdir():  # the next script's run starts later
        os.utime(path, (since - 60, since - 60))
    (scratch / "scatter.png").write_bytes(b"png2")
    run_all.collect("scatter", scratch, out, since)  # no main table: only the zip grows
    assert sorted(p.name for p in out.iterdir()) == ["bench_files.zip", "extend.csv"]
    assert (out / "extend.csv").read_text() == (scratch / "extend.csv").read_text()
    with zipfile.ZipFile(out / "bench_files.zip") as archive:
        names = sorted(archive.namelist())
        assert archive.read("scatter.png") == b"png2"
    assert names == ["extend.csv", "extend.png", "extend_d128_b1.csv", "scatter.png"]


def test_quick_mode_follows_the_variable_run_all_sets(monkeypatch):
    """run_all --quick sets the variable harness.quick() reads in each script it starts."""
    harness = import_benchmark_module("harness")
    run_all = import_benchmark_module("run_all")
    assert run_all.QUICK_ENV == harness.QUICK_ENV
    monkeypatch.delenv(harness.QUICK_ENV, raising=False)
    assert not harness.quick() and harness.rep_ms() == harness.REP_MS
    monkeypatch.setenv(harness.QUICK_ENV, "1")
    assert harness.quick() and harness.rep_ms() == harness.QUICK_REP_MS < harness.REP_MS


def test_timed_patched_calls_prefill_their_prompts():
    """bench_generate's timed calls of a patched model find none of the prompt blocks its
    earlier calls stored (each has a fresh cache_salt), while repeating the prompts unsalted
    does find them: the benchmark times the prefill stock providers pay too."""
    import nanoserve

    bench = import_benchmark_module("bench_generate")
    model = bench.build_model(tiny=True, device="cpu")
    ids, mask, _ = bench.make_batches(True, "cpu", model.config.vocab_size)["batch1_prompt32"]
    nanoserve.patch_model(model, cuda_graphs=False)
    try:
        bench.run_generate(model, ids, mask, 2, "cpu")
        bench.run_generate(model, ids, mask, 2, "cpu")
        assert nanoserve.cache_stats(model)["prefix_hits"] == 1  # unsalted: found again
        out, _ = bench.timed(model, ids, mask, 2, "cpu", salted=True)
        assert out.shape == (1, 2)
        assert nanoserve.cache_stats(model)["prefix_hits"] == 0
    finally:
        nanoserve.unpatch_model(model)


def test_timed_patched_calls_find_the_pool_grown(monkeypatch):
    """bench_generate warms a patched model up at the timed length: the kept pool has grown
    to the timed calls' size before timing, so no timed call makes a new pool (on the GPU a
    new pool drops the captured graphs, and timed calls would capture them again)."""
    import nanoserve

    bench = import_benchmark_module("bench_generate")
    model = bench.build_model(tiny=True, device="cpu")
    ids, mask, lens = bench.make_batches(True, "cpu", model.config.vocab_size)["batch1_prompt32"]
    kept = []  # the kept pool's blocks before and after the timed calls
    timed = bench.timed

    def watched(model, *args, **kwargs):
        before = nanoserve.cache_stats(model)["kept_pool_blocks"]
        result = timed(model, *args, **kwargs)
        kept.append((before, nanoserve.cache_stats(model)["kept_pool_blocks"]))
        return result

    monkeypatch.setattr(bench, "timed", watched)
    new = 120  # the prompt and new tokens need more blocks than a pool's least (8 of 16)
    bench.PROVIDERS["nanoserve_eager"](model, ids, mask, lens, new, "cpu")
    assert len(kept) == 1
    before, after = kept[0]
    assert before == after >= -(-(ids.shape[1] + new) // 16)


@pytest.mark.parametrize("rows,before", [(1, 0), (3, 7)])
def test_forward_flops_count_what_torch_counts(rows, before):
    """bench_generate.forward_flops (the matrix work behind the system-prompt benchmark's
    ratio at equal FLOP/s) equals torch's FLOP counter over a tiny Llama's forward of one new
    token a row after ``before`` cached ones (eager attention: its products are the causal
    ones when one token attends), logits of the last token only."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    bench = import_benchmark_module("bench_generate")
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         vocab_size=50, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    ids = torch.randint(0, 50, (rows, before + 1))
    with torch.no_grad():
        if before:
            model(ids[:, :before], past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(ids[:, before:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    # (transformers 5.17 also counts its rotary table's product, inv_freq x positions: 24)
    assert bench.forward_flops(config, [(rows, 1, before)]) == pytest.approx(
        counter.get_total_flops(), rel=1e-3
    )


def test_system_prompt_rows_on_the_cpu(caplog):
    """bench_generate --system-prompt on a tiny model (no CUDA: no graphs, no profile): later
    calls find the system prompt (4 rows hit), every first call is timed (none captures),
    the FLOP ratio is the shared first call's work over a later one's (1 without sharing,
    where every call prefills every row), and the timer's hooks are on the model before the
    warm-ups (no call logs a salt changed by hooks: on the GPU that drops the warm-ups'
    graphs, and timed calls capture them again)."""
    import logging

    caplog.set_level(logging.INFO, logger="nanoserve")
    bench = import_benchmark_module("bench_generate")
    model = bench.build_model(tiny=True, device="cpu")
    shared, unshared = bench.system_prompt_calls(model, "cpu", tiny=True)
    config = model.config
    later = [(4, 8, 40)]
    assert shared["flops_first/later"] == round(
        bench.forward_flops(config, [(1, 40, 0), *later]) / bench.forward_flops(config, later), 2
    )
    assert shared["flops_first/later"] > 1 == unshared["flops_first/later"]
    assert shared["hits_last_call"] == 4 and unshared["hits_last_call"] == 0
    assert shared["first_calls_timed"] == unshared["first_calls_timed"] == bench.FIRST_CALLS_TIMED
    assert shared["timed_captures"] == shared["first_profile_captures"] == 0
    changed = [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()]
    assert changed == []
