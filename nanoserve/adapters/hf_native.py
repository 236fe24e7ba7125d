"""HF's own doors onto nanoserve: ``from_pretrained(..., attn_implementation="nanoserve")``
and ``model.generate_batch(...)``.

transformers checks an ``attn_implementation`` name against its ``AttentionInterface`` when
the model is built, and nothing else: a registered name loads, but nothing in transformers
would then patch ``generate``. So ``open_doors()`` (run by ``import nanoserve``) does two
explicit things:

- registers ``DOOR`` with attention and mask functions that refuse to run (a clear error
  naming ``patch_model``): a model can only reach them if it was built under that name
  without passing through the door below, and it must not silently run stock attention;
- wraps ``PreTrainedModel.from_pretrained`` and ``_from_config``: when the model they
  return asks for ``DOOR``, it is switched back to the attention transformers picks by
  default and handed to ``patch_model`` with the options of a ``PagedConfig``
  (``paged_config=``), so it is exactly the model ``patch_model`` gives. The pool and the
  graphs attach on the first ``generate``, as after ``patch_model``;
- wraps ``GenerationMixin.generate_batch``: on a patched model it runs on nanoserve's pool
  (``generate_batch.py``), on any other model it is transformers' own.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from dataclasses import asdict, dataclass

from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from nanoserve.adapters.attention import ATTN_NAME, DOOR
from nanoserve.adapters.family import KVLayout
from nanoserve.adapters.generate_batch import paged_generate_batch
from nanoserve.adapters.hf import patch_model
from nanoserve.adapters.sizing import PoolOptions
from nanoserve.adapters.step import state_of
from nanoserve.kernels.dispatch import check_backend
from nanoserve.log import get_logger

_LOADERS = ("from_pretrained", "_from_config")
# a model built inside another's loading (a composite model's sub-model) is not patched alone
_LOADING: ContextVar[bool] = ContextVar("nanoserve_loading", default=False)
_log = get_logger(__name__)


@dataclass(frozen=True)
class PagedConfig:
    """``patch_model``'s options, for ``from_pretrained(..., attn_implementation="nanoserve",
    paged_config=PagedConfig(...))``; each field means what the argument of that name of
    ``patch_model`` means. Checked when built."""

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | None = None
    cuda_graphs: bool = True
    compile_decode: bool = False
    fuse_decode: bool = True
    backend: str = "auto"
    keep_pools: bool = True
    prefix_sharing: bool = True
    decode_loop: bool = True
    kv_dtype: str | None = None
    kv_scale: float | None = None

    def __post_init__(self):
        PoolOptions(
            KVLayout(1, 1, 1),
            self.block_size,
            self.num_blocks,
            self.max_memory,
            self.kv_dtype,
            self.kv_scale,
        )
        flags = (
            "cuda_graphs", "compile_decode", "fuse_decode", "keep_pools",
            "prefix_sharing", "decode_loop",
        )  # fmt: skip
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        check_backend(self.backend)

    def options(self) -> dict:
        """The fields as ``patch_model`` keyword arguments."""
        return asdict(self)


def _not_patched(*args, **kwargs):
    raise RuntimeError(
        f'attn_implementation="{DOOR}": this model was built under that name without being '
        "patched (only from_pretrained and from_config patch it); call "
        "nanoserve.patch_model(model) on it instead"
    )


def _pass_door(model, paged_config: PagedConfig | None):
    """``model`` patched when it asks for ``DOOR`` (or for ``ATTN_NAME``, the patched
    models' own attention, which a loader is given by name or in a config a patched model
    holds: unpatched, it would run stock attention without a word); ValueError when
    ``paged_config`` is given to a model that does not."""
    if getattr(model.config, "_attn_implementation", None) not in (DOOR, ATTN_NAME):
        if paged_config is not None:
            raise ValueError(f'paged_config: given without attn_implementation="{DOOR}"')
        return model
    # what transformers picks when no attention is asked for: unpatch_model goes back to it
    default = model._check_and_adjust_attn_implementation(None, is_init_check=True)
    model.set_attn_implementation(default)
    paged_config = paged_config or PagedConfig()
    _log.info(
        '%s: attn_implementation="%s", patched with %s', type(model).__name__, DOOR, paged_config
    )
    return patch_model(model, **paged_config.options())


def _door(loader):
    """``loader`` (a classmethod's function) that passes the model it builds through the
    door; takes ``paged_config=``."""

    @functools.wraps(loader)
    def load(cls, *args, paged_config=None, **kwargs):
        if paged_config is not None and not isinstance(paged_config, PagedConfig):
            raise ValueError(
                f"paged_config: expected a nanoserve.PagedConfig, got {type(paged_config)}"
            )
        if _LOADING.get():
            return loader(cls, *args, **kwargs)
        token = _LOADING.set(True)
        try:
            result = loader(cls, *args, **kwargs)
        finally:
            _LOADING.reset(token)
        model = result[0] if isinstance(result, tuple) else result  # output_loading_info
        _pass_door(model, paged_config)
        return result

    load.nanoserve_door = loader
    return classmethod(load)


def _batch_door(hf_generate_batch):
    """``generate_batch`` that runs on nanoserve's pool when the model is patched."""

    @functools.wraps(hf_generate_batch)
    def generate_batch(self, *args, **kwargs):
        if state_of(self) is None:
            return hf_generate_batch(self, *args, **kwargs)
        return paged_generate_batch(self, *args, **kwargs)

    generate_batch.nanoserve_door = hf_generate_batch
    return generate_batch


def open_doors() -> None:
    """Register ``DOOR`` with transformers and wrap its loaders and ``generate_batch``
    (idempotent)."""
    AttentionInterface.register(DOOR, _not_patched)
    AttentionMaskInterface.register(DOOR, _not_patched)
    for name in _LOADERS:
        current = PreTrainedModel.__dict__[name].__func__
        if not hasattr(current, "nanoserve_door"):
            setattr(PreTrainedModel, name, _door(current))
    if not hasattr(GenerationMixin.generate_batch, "nanoserve_door"):
        GenerationMixin.generate_batch = _batch_door(GenerationMixin.generate_batch)
