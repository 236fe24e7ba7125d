"""The prefix salt's cost on the GPU: the content hash over a 1B-shaped Llama's weights.

Every patched ``generate`` call with prefix sharing on reads all of the model's parameters
and buffers once to name its cached prefixes (``prefix_salt.prefix_salt``). This times, on
the 1B shape of ``bench_generate.py`` (bf16, 148 tensors, 2.47 GB), each a whole call with
its read back to the host (``do_bench``, eager, L2 cleared): the content hash
(``content_digest``, one Triton launch), the float fingerprint it replaced on CUDA
(``_float_fingerprint``: two reductions a tensor), a ``DigestPlan`` laid out once and
launched again (what a call whose weights lie where they did runs), ``prefix_salt`` end to
end (the module walk, the hash, the key's digest) with the plan kept between calls and laid
out each call, and a pure read of the same bytes (the ceiling). The
check column compares the kernel's digest with the torch reference on the first tensors.
Usage: python3 benchmarks/bench_content_hash.py [--quick]; writes $OUT/content_hash.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_content_hash")

from bench_generate import build_model  # noqa: E402
from harness import ceiling, set_quick, show_table, time_eager, versions  # noqa: E402

from nanoserve.adapters.prefix_salt import _float_fingerprint, prefix_salt  # noqa: E402
from nanoserve.kernels.content_hash import DigestPlan, content_digest  # noqa: E402

COLUMNS = ["provider", "check", "ms", "GB/s", "vs_read"]


class _SaltState:
    """The fields of a PatchState that prefix_salt reads and writes; ``digest_plans`` None
    lays the hash out anew each call (as before plans were kept)."""

    def __init__(self, keep_plans: bool):
        self.backend = "auto"
        self.salt_key = None
        self.salt = b""
        self.digest_plans = {} if keep_plans else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    set_quick(args.quick)
    print(versions(), flush=True)
    model = build_model(False, "cuda")
    tensors = [*model.parameters(), *model.buffers()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    head = tensors[:4]
    check = content_digest(head) == content_digest(head, backend="torch")
    read = ceiling(nbytes, 1, graph=False).median
    kept, anew = _SaltState(keep_plans=True), _SaltState(keep_plans=False)
    plan = DigestPlan(tensors)
    providers = {
        "pure read (ceiling)": None,
        "content_digest (Triton)": lambda: content_digest(tensors),
        "DigestPlan.launch (laid out once)": lambda: plan.launch().result(),
        "float fingerprint (before)": lambda: _float_fingerprint(torch.device("cuda"), tensors),
        "prefix_salt (whole)": lambda: prefix_salt(model, None, kept),
        "prefix_salt (whole, hash laid out each call)": lambda: prefix_salt(model, None, anew),
    }
    rows = []
    for name, fn in providers.items():
        us = read if fn is None else time_eager([fn]).median
        rows.append(
            {
                "provider": name,
                "check": "ok" if check else "DIFFERS",
                "ms": round(us / 1e3, 3),
                "GB/s": round(nbytes / us / 1e3, 1),
                "vs_read": round(us / read, 2),
            }
        )
    print(f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB", flush=True)
    show_table(rows, "content_hash.csv", COLUMNS)
    if not check:
        sys.exit("bench_content_hash: the kernel's digest differs from the reference")


if __name__ == "__main__":
    main()
