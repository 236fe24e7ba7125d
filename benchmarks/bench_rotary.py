"""The rotary embedding as a decode step runs it: nanoserve's kernel (q and k in one launch)
beside transformers' apply_rotary_pos_emb (eager, about ten kernels) and a pure read of the
bytes it moves (q, k, cos and sin read, q and k written), bf16, on q and k as the attention
module hands them over (transposed views of the projections' output), under CUDA-graph
replay with inputs rotated past the L2. Two more tables: a step's cos and sin tables
(``rotary_cos_sin``, one launch, beside the rotary embedding module's forward) and a layer's
q/k/v projections with q and k rotated in their epilogue (``small_batch_linear_rotary``)
beside the projections followed by the rotation's own launch, with the weights' pure read.
Usage: python3 benchmarks/bench_rotary.py [--quick]; writes $OUT/rotary.csv,
$OUT/rotary_tables.csv and $OUT/rotary_qkv.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_rotary")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    set_quick,
    show_table,
    time_graph,
    versions,
)
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from nanoserve.kernels.rotary import apply_rotary, rotary_cos_sin  # noqa: E402
from nanoserve.kernels.small_batch_linear import (  # noqa: E402
    small_batch_linear,
    small_batch_linear_rotary,
)

# (name, q heads, kv heads, head_dim)
SHAPES = (("1B", 32, 8, 64), ("8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128), ("d256", 16, 8, 256))
ROWS = (1, 16, 128)
# (name, q heads, kv heads, head_dim, hidden size): the layers' q/k/v with the rotation
QKV_SHAPES = (("1B", 32, 8, 64, 2048), ("8B", 32, 8, 128, 4096), ("SmolLM2", 9, 3, 64, 576))
COLUMNS = ["shape", "rows", "provider", "us", "vs_read", "equal"]


def step_inputs(rows: int, q_heads: int, kv_heads: int, dim: int):
    """q and k [rows, H, 1, D] as views of one projection output; cos, sin [rows, 1, D]."""
    fused = torch.randn(rows, 1, (q_heads + 2 * kv_heads) * dim, device="cuda").bfloat16()
    q = fused[..., : q_heads * dim].view(rows, 1, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim : (q_heads + kv_heads) * dim].view(rows, 1, kv_heads, dim)
    angles = torch.rand(rows, 1, dim, device="cuda") * 100
    return q, k.transpose(1, 2), angles.cos().bfloat16(), angles.sin().bfloat16()


def time_shape(name: str, q_heads: int, kv_heads: int, dim: int, table: list[dict]) -> None:
    for rows in ROWS:
        nbytes = 2 * (2 * rows * (q_heads + kv_heads) * dim + 2 * rows * dim)
        sets = num_input_sets(nbytes, max_sets=32)
        inputs = [step_inputs(rows, q_heads, kv_heads, dim) for _ in range(sets)]
        pairs = zip(apply_rotary(*inputs[0]), apply_rotary_pos_emb(*inputs[0]), strict=True)
        equal = all(torch.equal(a, b) for a, b in pairs)
        timings = [
            ("transformers", time_graph([lambda t=t: apply_rotary_pos_emb(*t) for t in inputs])),
            ("nanoserve", time_graph([lambda t=t: apply_rotary(*t) for t in inputs])),
            ("read", ceiling(nbytes, sets, graph=True)),
        ]
        read = timings[-1][1].median
        for provider, timing in timings:
            row = {"shape": name, "rows": rows, "provider": provider, "us": f"{timing.median:.2f}"}
            row |= {"vs_read": f"{timing.median / read:.2f}"}
            table.append(row | {"equal": str(equal) if provider == "nanoserve" else ""})


def time_tables(dim: int, rows: int, table: list[dict]) -> None:
    """A step's cos and sin for ``rows`` positions: the module's forward against one launch."""
    config = LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim)
    module = LlamaRotaryEmbedding(config).cuda()
    x = torch.empty(1, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 8192, (rows, 1), device="cuda")
    stock = module(x, positions)
    ours = rotary_cos_sin(positions, module.inv_freq, module.attention_scaling, x.dtype)
    equal = all(torch.equal(a, b) for a, b in zip(ours, stock, strict=True))
    args = (positions, module.inv_freq, module.attention_scaling, x.dtype)
    for provider, fn in (
        ("transformers", lambda: module(x, positions)),
        ("nanoserve", lambda: rotary_cos_sin(*args)),
    ):
        row = {"head_dim": dim, "rows": rows, "provider": provider}
        row |= {"us": f"{time_graph([fn]).median:.2f}"}
        table.append(row | {"equal": str(equal) if provider == "nanoserve" else ""})


def time_qkv(name: str, q_heads: int, kv_heads: int, dim: int, hidden: int, rows: int,
             table: list[dict]) -> None:  # fmt: skip
    """q/k/v projections with the rotation in their epilogue against the projections and
    then the rotation's own launch, weights rotated past the L2."""
    sizes = (q_heads * dim, kv_heads * dim, kv_heads * dim)
    nbytes = 2 * hidden * sum(sizes)
    sets = num_input_sets(nbytes, max_sets=16)
    x = torch.randn(rows, hidden, device="cuda").bfloat16()
    weight_sets = [
        [torch.randn(n, hidden, device="cuda").bfloat16() / hidden**0.5 for n in sizes]
        for _ in range(sets)
    ]
    angles = torch.rand(rows, dim, device="cuda") * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()

    def apart(weights):
        out = small_batch_linear(x, weights, weights_ready=True)
        q = out[:, : sizes[0]].view(rows, 1, q_heads, dim).transpose(1, 2)
        k = out[:, sizes[0] : sizes[0] + sizes[1]].view(rows, 1, kv_heads, dim).transpose(1, 2)
        return apply_rotary(q, k, cos.view(rows, 1, dim), sin.view(rows, 1, dim))

    together = small_batch_linear_rotary(x, weight_sets[0], None, cos, sin)
    alone = apart(weight_sets[0])
    equal = torch.equal(together[1], alone[0].reshape(rows, -1))
    equal &= torch.equal(together[2], alone[1].reshape(rows, -1))
    timings = [
        ("projections, then rotation", time_graph([lambda w=w: apart(w) for w in weight_sets])),
        (
            "rotation in the projections",
            time_graph(
                [
                    lambda w=w: small_batch_linear_rotary(x, w, None, cos, sin, weights_ready=True)
                    for w in weight_sets
                ]
            ),
        ),  # fmt: skip
        ("read", ceiling(nbytes, sets, graph=True)),
    ]
    read = timings[-1][1].median
    for provider, timing in timings:
        row = {"shape": name, "rows": rows, "provider": provider, "us": f"{timing.median:.2f}"}
        row |= {"vs_read": f"{timing.median / read:.2f}"}
        table.append(row | {"equal": str(equal) if provider.startswith("rotation in") else ""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    set_quick(parser.parse_args().quick)
    torch.manual_seed(0)
    table: list[dict] = []
    for shape in SHAPES:
        time_shape(*shape, table)
    tables: list[dict] = []
    for dim in (64, 128):
        for rows in ROWS:
            time_tables(dim, rows, tables)
    qkv: list[dict] = []
    for name, q_heads, kv_heads, dim, hidden in QKV_SHAPES:
        for rows in (1, 16):
            time_qkv(name, q_heads, kv_heads, dim, hidden, rows, qkv)
    print(versions())
    show_table(table, "rotary", COLUMNS)
    show_table(tables, "rotary_tables", ["head_dim", "rows", "provider", "us", "equal"])
    show_table(qkv, "rotary_qkv", COLUMNS)


if __name__ == "__main__":
    main()
