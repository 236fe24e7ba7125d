"""What a generate call reads off every module of the model, read in one walk.

At a call's start nanoserve asks each module several questions: does it drop out at random,
does its rotary embedding depend on the call's length, what hooks does it carry, which
tensors does it hold (the pool's devices, the decode graphs' addresses, the prefix salt),
what else does its forward read (its class and attributes: the salt and the graphs'
signature).
Each question used to walk the modules itself, some twice a call: a few milliseconds of
host time on a billion-parameter model, paid by every call before its first token. A
``ModelWalk`` lists the modules once and answers each question at most once a call.
"""

from __future__ import annotations

import functools

import torch
from transformers import PretrainedConfig

from nanoserve.adapters.module_attrs import module_attr
from nanoserve.adapters.prefix_salt import (
    attention_dropout_rate,
    drops_out,
    length_dependent_rope,
    structure_key,
)
from nanoserve.adapters.user_hooks import HookScan, scan_hooks


class ModelWalk:
    """The modules of ``model`` as they stand at a call's start, with the answers read off
    them (each computed on first use). Valid for one call: modules, hooks and attributes may
    change between calls."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.named: list[tuple[str, torch.nn.Module]] = list(model.named_modules())
        self.modules: list[torch.nn.Module] = [module for _, module in self.named]

    @functools.cached_property
    def dropout(self) -> str | None:
        """``prefix_salt.drops_out``'s phrase, or None."""
        return drops_out(self.model, self.modules)

    @functools.cached_property
    def stock_only(self) -> str | None:
        """Why this model must run as stock does, on stock's cache (a phrase), or None:
        ``tokens_depend_on_the_batch``, ``attends_both_ways``, ``drops_attention_out``,
        ``steps_set_on_instance``."""
        return (
            tokens_depend_on_the_batch(self.named)
            or attends_both_ways(self.named)
            or drops_attention_out(self.named)
            or steps_set_on_instance(self.model)
        )

    @functools.cached_property
    def layer_config(self) -> str | None:
        """``config_of_its_own``'s module name, or None."""
        return config_of_its_own(self.named, self.model.config)

    @functools.cached_property
    def rope(self) -> str | None:
        """``prefix_salt.length_dependent_rope``'s phrase, or None."""
        return length_dependent_rope(self.model, self.modules)

    @functools.cached_property
    def hooks(self) -> HookScan:
        """``user_hooks.scan_hooks`` of the model."""
        return scan_hooks(self.model, self.named)

    @functools.cached_property
    def structure(self) -> tuple:
        """``prefix_salt.structure_key`` of the model: what its forward reads besides the
        tensors' values (module classes and attributes, configs, hooks, adapters on)."""
        return structure_key(self.model, self.modules)

    @functools.cached_property
    def parameters(self) -> list[torch.Tensor]:
        """Every parameter once, in ``model.parameters()``'s order."""
        return _unique(self.modules, "_parameters")

    @functools.cached_property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer once, in ``model.buffers()``'s order."""
        return _unique(self.modules, "_buffers")


# torch's dynamically quantized layers (quantize_dynamic): one activation scale a forward
_DYNAMIC_QUANTIZED = ("torch.ao.nn.quantized.dynamic.", "torch.nn.quantized.dynamic.")


def tokens_depend_on_the_batch(named: list[tuple[str, torch.nn.Module]]) -> str | None:
    """Which module computes a token's output from every token of its forward (a layer
    quantized dynamically takes its activation scale over the whole input), as a phrase, or
    None. Such a model's tokens change with what else a forward holds: shared prefixes,
    padded buckets and a compacted batch would all move them off stock's."""
    for name, module in named:
        if type(module).__module__.startswith(_DYNAMIC_QUANTIZED):
            where = name or "the model"
            return f"{where} ({type(module).__name__}) is quantized dynamically"
    return None


def attends_both_ways(named: list[tuple[str, torch.nn.Module]]) -> str | None:
    """Which module has ``is_causal`` set False, as a phrase, or None. Stock's sdpa and flash
    attention read that flag off the module (sdpa where no mask is needed, flash always) and
    then let a prompt's tokens attend to later ones; paged attention is causal."""
    for name, module in named:
        if module_attr(module, "is_causal", True) is False:
            return f"{name or 'the model'}.is_causal is False (attention both ways)"
    return None


def drops_attention_out(named: list[tuple[str, torch.nn.Module]]) -> str | None:
    """Which module asks its attention for dropout (training mode, an ``attention_dropout``
    above 0), as a phrase, or None. Stock's attention applies it and the paged kernels do
    not; trainers (trl's GRPO) generate in training mode, where ``model.eval()`` is not
    theirs to call."""
    for name, module in named:
        rate = attention_dropout_rate(module)
        if module.training and rate > 0:
            return f"{name or 'the model'} drops attention out ({rate}) in training mode"
    return None


# what generate calls to build each forward's inputs from the prompt and the tokens so far
STEP_METHODS = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")


def steps_set_on_instance(model) -> str | None:
    """Which of ``STEP_METHODS`` is set on ``model`` itself, not its class, as a phrase, or
    None. peft's prompt learning sets ``prepare_inputs_for_generation`` there for its call:
    the prefill then feeds virtual tokens before the prompt (the mask, the positions and
    the pool's size all count more tokens than ``input_ids`` holds), or swaps in a cache of
    its own; only stock's generate knows what such a method does."""
    for name in STEP_METHODS:
        if name in vars(model):
            return f"model.{name} is set on the instance"
    return None


def config_of_its_own(named: list[tuple[str, torch.nn.Module]], config) -> str | None:
    """The name of the first module holding a transformers config other than ``config``
    (the model's), or None. Attention modules read ``config._attn_implementation``, which
    patching switches on the model's config only: a layer with its own copy (peft's
    ``layer_replication`` deep-copies each layer) would run stock attention on the paged
    pools."""
    for name, module in named:
        own = module.__dict__.get("config")
        if own is not None and own is not config and isinstance(own, PretrainedConfig):
            return name
    return None


def layer_past(named: list[tuple[str, torch.nn.Module]], num_layers: int) -> str | None:
    """The name and ``layer_idx`` of the first module whose ``layer_idx`` (the cache layer
    its attention writes) is not below ``num_layers`` (the layers the paged pools were laid
    out for at ``patch_model``), as "name (layer_idx N)", or None. A layer added after
    patching would reach the cache only halfway through a forward."""
    for name, module in named:
        index = module.__dict__.get("layer_idx")
        if type(index) is int and index >= num_layers:
            return f"{name} (layer_idx {index})"
    return None


def _unique(modules: list[torch.nn.Module], table: str) -> list[torch.Tensor]:
    seen, found = set(), []
    for module in modules:
        for tensor in module.__dict__[table].values():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
    return found
