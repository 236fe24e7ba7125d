"""HF adapters: all of nanoserve's knowledge of transformers lives here.

``registry.py`` lists the supported model families; ``hf.py`` patches a model
(``patch_model`` / ``unpatch_model`` / ``cache_stats``); ``step.py`` owns the patch state and
each forward's paged step; ``hf_cache.py`` is the transformers ``Cache`` over the paged store;
``attention.py`` the attention and mask functions.
"""

from nanoserve.adapters.versions import check_transformers_version

check_transformers_version()  # before importing what another release may lack

from nanoserve.adapters.family import Family, KVLayout
from nanoserve.adapters.hf import (
    cache_stats,
    decode_graph_stats,
    last_cache,
    patch_model,
    release_memory,
    unpatch_model,
)
from nanoserve.adapters.hf_cache import PagedCache
from nanoserve.adapters.hf_native import PagedConfig
from nanoserve.adapters.registry import FAMILIES, family_for, supported_model_types
from nanoserve.adapters.step import state_of

__all__ = [
    "FAMILIES",
    "Family",
    "KVLayout",
    "PagedCache",
    "PagedConfig",
    "cache_stats",
    "decode_graph_stats",
    "family_for",
    "last_cache",
    "patch_model",
    "release_memory",
    "state_of",
    "supported_model_types",
    "unpatch_model",
]
