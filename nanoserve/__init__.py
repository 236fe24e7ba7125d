"""nanoserve: a paged KV cache with Triton kernels under stock Hugging Face models.

Importing it makes ``from_pretrained(..., attn_implementation="nanoserve")`` load a patched
model (``adapters/hf_native.py``) when a supported transformers is installed, and applies
``NANOSERVE_LOG`` (``log.py``).
"""

import importlib.util
import warnings

from nanoserve.cache import BlockAllocator, BlockTable, OutOfBlocks, PagedKVCache
from nanoserve.log import configure_from_env

configure_from_env()

# The HF adapter imports transformers; it is loaded on first use so that the cache and the
# kernels stay importable (and quick to import) without it.
_ADAPTER_NAMES = (
    "PagedCache",
    "PagedConfig",
    "cache_stats",
    "decode_graph_stats",
    "patch_model",
    "release_memory",
    "unpatch_model",
)


def __getattr__(name):
    if name in _ADAPTER_NAMES:
        from nanoserve import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")


def _open_doors() -> None:
    try:
        from nanoserve.adapters.hf_native import open_doors
    except ImportError as error:  # the adapters' version check: patch_model says it again
        if type(error).__name__ != "UnsupportedTransformers":
            raise
        warnings.warn(f"{error}; patch_model and the nanoserve doors are off", stacklevel=3)
        return
    open_doors()


if importlib.util.find_spec("transformers") is not None:
    _open_doors()


__all__ = [
    "BlockAllocator",
    "BlockTable",
    "OutOfBlocks",
    "PagedCache",
    "PagedConfig",
    "PagedKVCache",
    "cache_stats",
    "decode_graph_stats",
    "patch_model",
    "release_memory",
    "unpatch_model",
]
__version__ = "0.1.0"
