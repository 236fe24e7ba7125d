"""Run the benchmarks one after another, each in its own Python process.

bench_decode, bench_extend and bench_scatter always (or those named with --only, such as
generate_batch); bench_generate too with --generate. Each script's output streams through as
it runs; at the end each script's exit status, time and main table (read back from its CSV,
never from its printed output) are printed again, in order.

The scripts write into a scratch folder; as each one ends, its main table (bench_decode.csv,
extend.csv, scatter.csv, generate.csv, ...) is copied to $OUT (or --out; a temporary folder
when neither is given) and everything else it wrote (the plots RESULTS.md shows, such as
decode_d128.png and extend.png, and perf_report's per-plot CSVs and PNGs) is added to
$OUT/bench_files.zip: a few files in all, whatever the number of plots, and what finished
is there even when a later script is cut off.

``--quick`` runs the kernel benchmarks' quick mode: every shape class at fewer sizes, with
shorter timings. Usage:
    python3 benchmarks/run_all.py [--quick] [--generate] [--only decode,...] [--out DIR] [-- ARGS]
Arguments after ``--`` go to every script.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_BENCHES = ("decode", "extend", "scatter")
ZIP_NAME = "bench_files.zip"
QUICK_ENV = "NANOSERVE_BENCH_QUICK"  # as in harness.py; read by the kernel benchmarks
# the table RESULTS.md takes from each script (the others it writes are plot data)
MAIN_TABLE = {
    "decode": "bench_decode.csv",
    "extend": "extend.csv",
    "scatter": "scatter.csv",
    "generate": "generate.csv",
    "generate_batch": "generate_batch.csv",
}


def run_one(name: str, env: dict, extra: list[str]) -> tuple[int, float, str]:
    """Run benchmarks/bench_<name>.py, its output streaming through; (exit code, seconds,
    its last output line)."""
    cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *extra]
    print(f"\n=== {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        last = line.strip() or last
    code = proc.wait()
    return code, time.perf_counter() - start, last


def markdown(path: Path) -> str:
    """The CSV at ``path`` as a markdown table."""
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    if not rows:
        return "(empty table)"
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def tables_written(name: str, out: Path, since: float) -> str:
    """What bench_<name> wrote under ``out`` since ``since`` (a time.time()): its main table
    in markdown, or the names of the CSVs it wrote, or a line saying there are none."""
    written = sorted(p for p in out.glob("*.csv") if p.stat().st_mtime >= since)
    main = out / MAIN_TABLE.get(name, f"{name}.csv")
    if main in written:
        return markdown(main)
    if written:
        return "tables: " + ", ".join(p.name for p in written)
    return "(no table written)"


def collect(name: str, scratch: Path, out: Path, since: float) -> None:
    """Copy bench_<name>'s main table from ``scratch`` to ``out`` and add every file it wrote
    since ``since`` (the main table too) to ``out``/bench_files.zip, replacing older entries
    of the same name."""
    written = sorted(p for p in scratch.iterdir() if p.is_file() and p.stat().st_mtime >= since)
    main = scratch / MAIN_TABLE.get(name, f"{name}.csv")
    if main in written:
        shutil.copy2(main, out / main.name)
    archive = out / ZIP_NAME
    kept: dict[str, bytes] = {}
    if archive.exists():
        with zipfile.ZipFile(archive) as old:
            names = {p.name for p in written}
            kept = {n: old.read(n) for n in old.namelist() if n not in names}
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as new:
        for entry, data in kept.items():
            new.writestr(entry, data)
        for path in written:
            new.write(path, path.name)


def main() -> int:
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="also run bench_generate")
    parser.add_argument("--quick", action="store_true", help="kernel benchmarks: fewer sizes")
    parser.add_argument("--only", default=None, help="comma list of decode,extend,scatter,...")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for CSVs/plots")
    args = parser.parse_args(argv)
    names = list(KERNEL_BENCHES) + (["generate"] if args.generate else [])
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    out = Path(args.out or tempfile.mkdtemp(prefix="nanoserve_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="nanoserve_bench_files_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(scratch))
    if args.quick:
        env[QUICK_ENV] = "1"
    results = []
    try:
        for name in names:
            since = time.time() - 1  # file times may be coarser than a second
            code, seconds, last = run_one(name, env, extra)
            results.append((name, code, seconds, last, tables_written(name, scratch, since)))
            collect(name, scratch, out, since)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n=== summary (main tables in {out}, plots and per-plot CSVs in {out / ZIP_NAME})")
    for name, code, seconds, last, tables in results:
        print(f"\n## bench_{name}: exit {code}, {seconds:.0f} s")
        print(tables if code == 0 else last)
    return int(any(code != 0 for _, code, *_ in results))


if __name__ == "__main__":
    sys.exit(main())
