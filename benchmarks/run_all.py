"""Run the benchmarks one after another, each in its own Python process.

bench_decode, bench_extend and bench_scatter always (or those named with --only);
bench_generate too with --generate. Each script's output streams through as it runs; at the
end every script's final table is printed again, in order, with its exit status and time.
CSVs and plots go under $OUT (or --out). Usage:
    python3 benchmarks/run_all.py [--generate] [--only decode,extend] [--out DIR] [-- ARGS]
Arguments after ``--`` go to every script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_BENCHES = ("decode", "extend", "scatter")


def last_table(text: str) -> str:
    """The last run of consecutive markdown table lines in ``text``."""
    lines = text.splitlines()
    end = len(lines)
    while end and not lines[end - 1].startswith("|"):
        end -= 1
    start = end
    while start and lines[start - 1].startswith("|"):
        start -= 1
    return "\n".join(lines[start:end])


def run_one(name: str, env: dict, extra: list[str]) -> tuple[int, float, str]:
    """Run benchmarks/bench_<name>.py, echoing its output; (exit code, seconds, output)."""
    cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *extra]
    print(f"\n=== {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    captured = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        captured.append(line)
    code = proc.wait()
    return code, time.perf_counter() - start, "".join(captured)


def main() -> int:
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="also run bench_generate")
    parser.add_argument("--only", default=None, help="comma list of decode,extend,scatter,...")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for CSVs/plots")
    args = parser.parse_args(argv)
    names = list(KERNEL_BENCHES) + (["generate"] if args.generate else [])
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        env["OUT"] = args.out
    results = [(name, *run_one(name, env, extra)) for name in names]
    print("\n=== summary")
    for name, code, seconds, text in results:
        print(f"\n## bench_{name}: exit {code}, {seconds:.0f} s")
        print(last_table(text) or "(no table)")
    return int(any(code != 0 for _, code, _, _ in results))


if __name__ == "__main__":
    sys.exit(main())
