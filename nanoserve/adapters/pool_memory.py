"""A pool sized for a call that cannot fit in memory is refused before it is allocated.

The default pool holds every row's prompt plus ``max_new_tokens``, reserved up front. A
``max_new_tokens`` far past what the rows will generate (stock grows its cache only as
tokens come) can ask for more than the devices hold; so can a pool fixed by
``patch_model(num_blocks=...)`` or ``max_memory=``. That would end in an out-of-memory error
from deep inside the allocator (or the process killed), so the call is refused first,
naming the argument.
"""

from __future__ import annotations

import torch

from nanoserve.adapters.sizing import PoolOptions, PoolSize


def check_pool_fits(
    size: PoolSize, options: PoolOptions, model, reclaimable: int = 0, parameters=None
) -> None:
    """ValueError naming ``max_new_tokens`` (a pool sized for this call), or ``num_blocks`` /
    ``max_memory`` (a pool of fixed size), when the pool needs more bytes than are free on the
    devices holding ``model``'s parameters, plus ``reclaimable`` (a kept pool the call lets
    go). ``parameters``: ``model.parameters()`` when already listed."""
    sizes = options.group_block_bytes(model.dtype)
    blocks = size.group_blocks or (size.num_blocks,)
    need = sum(b * s for b, s in zip(blocks, sizes, strict=True))
    parameters = model.parameters() if parameters is None else parameters
    devices = sorted({p.device for p in parameters}, key=str)
    free = [free_bytes(d) for d in devices]
    if not devices or any(f is None for f in free) or need <= sum(free) + reclaimable:
        return
    gib = 2**30
    pool = f"{size.num_blocks} blocks of {options.block_size} tokens"
    where = f"{need / gib:.1f} GiB, more than the {sum(free) / gib:.1f} GiB free on " + ", ".join(
        map(str, devices)
    )
    if options.fixed:
        name = "num_blocks" if options.num_blocks is not None else "max_memory"
        raise ValueError(
            f"{name}: the KV pool patch_model was given ({pool}) needs {where}; give a "
            f"smaller {name}, or leave it out to size each call's pool by its rows"
        )
    raise ValueError(
        f"max_new_tokens: this call's KV pool ({pool}, room for every row's prompt and "
        f"max_new_tokens) needs {where}; lower max_new_tokens (or max_length), or give "
        "patch_model a pool size (max_memory= or num_blocks=): a call then raises "
        "OutOfBlocks only if its rows really outgrow it"
    )


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation may take on ``device`` (for CUDA, what the driver has free plus
    what PyTorch's allocator holds unused), or None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as info:
                for line in info:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None
