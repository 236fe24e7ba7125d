"""Backend choice and device facts shared by the launchers (no kernels here)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")

# Off a GPU (the Triton interpreter) there are no SMs to count; a small nominal number still
# makes the split-KV path run in CPU tests.
NOMINAL_SM_COUNT = 4


def check_backend(backend: str) -> None:
    """Raise ValueError naming ``backend`` unless it is "auto", "triton" or "torch"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """True when ``backend`` picks the Triton kernel for data living where ``tensor`` lives.

    "auto" picks Triton for CUDA tensors of a dtype the kernels take (float16, bfloat16,
    float32, and float8_e4m3fn / int8 pools) when Triton is installed, and the reference
    otherwise; "triton" forces it (on CPU this needs TRITON_INTERPRET=1); "torch" forces the
    reference.
    """
    check_backend(backend)
    if backend == "torch":
        return False
    supported = tensor.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.int8,
    )
    if backend == "auto":
        return tensor.is_cuda and supported and triton_installed()
    if not supported:
        raise ValueError(
            f"backend: 'triton' does not take {str(tensor.dtype).removeprefix('torch.')} "
            "tensors; use 'torch' or 'auto'"
        )
    if not triton_installed():
        raise ValueError("backend: 'triton' needs the triton package, which is not installed")
    if not tensor.is_cuda and not _interpreting():
        raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1")
    return True


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def float_input_problem(name: str, tensor: torch.Tensor) -> str | None:
    """Why an activation argument of a norm, rotary or linear launcher is refused for its
    dtype (the ValueError's message), or None: those take float16, bfloat16 and float32 (and
    float64 on the torch reference); an integer or FP8 tensor would come back truncated."""
    if tensor.dtype in FLOAT_DTYPES:
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{name}: expected float16, bfloat16, float32 or float64, got {dtype}"


def like_problem(name: str, tensor, like_name: str, like: torch.Tensor) -> str | None:
    """Why ``tensor`` (argument ``name``) is refused for not being a tensor of ``like``'s
    shape, dtype and device (argument ``like_name``; no broadcasting), or None."""
    if not isinstance(tensor, torch.Tensor):
        return f"{name}: expected a tensor, got {type(tensor).__name__}"
    if (tensor.shape, tensor.dtype, tensor.device) != (like.shape, like.dtype, like.device):
        return (
            f"{name}: expected {like_name}'s shape {tuple(like.shape)}, dtype {like.dtype} and "
            f"device {like.device}, got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
        )
    return None


def meta_problem(name: str, tensor: torch.Tensor) -> str | None:
    """Why a launcher refuses ``tensor`` for lying on the meta device (it holds no values to
    compute from), or None. Checked after the shapes, which meta tensors can test without
    memory."""
    if tensor.device.type == "meta":
        return f"{name}: a meta tensor holds no values (load the weights onto a device first)"
    return None


def interpreted_bfloat16(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel's ``tl.dot`` would take bfloat16 CPU tensors in Triton's
    interpreter, whose bfloat16 dot gives wrong sums (float16 and float32 are right)."""
    return _interpreting() and any(t.dtype == torch.bfloat16 and not t.is_cuda for t in tensors)


def refuse_interpreted_bfloat16(*tensors: torch.Tensor) -> None:
    """ValueError naming ``backend`` when the Triton attention or linear kernels would run
    on bfloat16 CPU tensors in Triton's interpreter (``tensors``: those whose dtype the
    kernels' ``tl.dot`` tiles take: the pools; INT8 pools, and FP8 pools in the extend
    kernel, meet the query in its dtype, so the query is passed with them; decode meets FP8
    tiles in float16; the linear kernel's x): a wrong answer must not pass for one."""
    if interpreted_bfloat16(*tensors):
        raise ValueError(
            "backend: 'triton' under TRITON_INTERPRET=1 computes bfloat16 products wrongly "
            "(the interpreter's tl.dot on bfloat16); use float32 or float16, backend='auto' "
            "or 'torch' on the CPU, or a GPU"
        )


@functools.cache
def triton_installed() -> bool:
    """True when the triton package can be imported (checked once; nothing is imported)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


def _interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); a nominal 4 off CUDA."""
    if device.type != "cuda":
        return NOMINAL_SM_COUNT
    return _sm_count(_cuda_index(device))


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def supports_pdl(device: torch.device) -> bool:
    """True on NVIDIA GPUs of compute capability 9.0 or later (programmatic dependent launch);
    False off CUDA, under TRITON_INTERPRET=1 (the interpreter has no griddepcontrol, even for
    CUDA tensors) and on ROCm (no such instruction)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if _interpreting() or os.environ.get("NANOSERVE_PDL") == "0":  # (the A/B switch)
        return False
    return _capability_major(_cuda_index(device)) >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch options for a kernel that opens with ``triton_common.pdl_enter``: programmatic
    dependent launch where ``supports_pdl``, else none."""
    return {"launch_pdl": True} if supports_pdl(device) else {}


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dim is dense (stride 1, or at most one element), else a
    contiguous copy.

    The kernels index metadata (slot_mapping, seq_lens, cu_seqlens_q, a block_tables row) as
    ``base + i``: a strided view would silently read the wrong entries. Metadata built by the
    cache is already dense, so this costs nothing there and adds no copy to a captured graph.
    """
    if tensor.dim() == 0 or tensor.shape[-1] <= 1 or tensor.stride(-1) == 1:
        return tensor
    return tensor.contiguous()


def unit_stride_rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` [..., width] as rows [R, width] whose last dim has unit stride: a view where
    the layout allows it (rows may be strided), else a contiguous copy."""
    rows = tensor.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def floor_pow2(n: int) -> int:
    """Largest power of two <= n, and 1 for n < 1 (a split count rounded down)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def keys_in_reach(
    block_tables: torch.Tensor, block_size: int, sliding_window: int | None, new_tokens: int
) -> int:
    """Keys a row of a call can attend to, from shapes only: what the block tables [S, width]
    hold (width x ``block_size``), and under a sliding window at most the window plus the
    call's ``new_tokens`` a row (a host bound: the step's longest row, or all its tokens)."""
    history = block_tables.shape[1] * block_size
    if sliding_window is not None:
        history = min(history, sliding_window + new_tokens)
    return history


def head_dim_pad(head_dim: int) -> int:
    """Width of the attention kernels' head-dim tiles: the power of two >= head_dim, and at
    least 16, the smallest reduction ``tl.dot`` compiles on NVIDIA GPUs (head_dim 8 failed to
    compile; the padding lanes are masked off)."""
    return max(16, next_pow2(head_dim))
