"""The ``attn_implementation="nanoserve"`` door: a tiny random Llama saved to disk, loaded
through ``from_pretrained`` / ``from_config``, is the model ``patch_model`` gives."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_families import GREEDY, padded_batch, tiny_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import nanoserve
from nanoserve.adapters import state_of


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random-weight Llama saved with save_pretrained (fresh weights per module run)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", seed=int(torch.randint(0, 2**31, ()))).save_pretrained(path)
    return path


def generate(model):
    with torch.no_grad():
        return model.generate(**padded_batch([3, 7, 5], 7, seed=11), max_new_tokens=9, **GREEDY)


def test_door_gives_patch_models_tokens_and_model(folder):
    """Greedy tokens of a left-padded batch equal stock's and patch_model's; the door leaves
    the same attention switch and options as patch_model, and unpatching returns to stock."""
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert state_of(stock) is None  # a load without the door is left alone
    expected = generate(stock)
    nanoserve.patch_model(stock)
    by_patch = generate(stock)

    door = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="nanoserve"
    ).eval()
    assert torch.equal(generate(door), expected) and torch.equal(by_patch, expected)
    assert door.config._attn_implementation == stock.config._attn_implementation
    assert state_of(door).pool == state_of(stock).pool
    assert nanoserve.cache_stats(door)["tokens"] > 0  # the call ran on the paged pool
    nanoserve.unpatch_model(door)
    assert door.config._attn_implementation == "sdpa"
    assert torch.equal(generate(door), expected)


def test_the_door_name_set_by_hand_is_undone_by_unpatching(folder):
    """``set_attn_implementation("nanoserve")`` on a patched model is refused, advising
    unpatch_model to run stock; unpatching then gives stock's attention and tokens (it left
    the door's name, whose attention refuses to run: a probe found it). Planted, reverted:
    ``_restore`` undoing only ATTN_NAME: failed."""
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = generate(stock)
    door = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="nanoserve"
    ).eval()
    door.set_attn_implementation("nanoserve")
    with pytest.raises(ValueError, match="unpatch_model"):
        generate(door)
    nanoserve.unpatch_model(door)
    assert door.config._attn_implementation == "sdpa"
    assert torch.equal(generate(door), expected)


def test_paged_config_reaches_the_patch(folder):
    config = nanoserve.PagedConfig(num_blocks=40, block_size=8, keep_pools=False)
    model, info = LlamaForCausalLM.from_pretrained(
        folder, attn_implementation="nanoserve", paged_config=config, output_loading_info=True
    )
    state = state_of(model)
    assert isinstance(info, dict)
    assert (state.pool.num_blocks, state.pool.block_size, state.keep_pools) == (40, 8, False)
    generate(model.eval())
    assert nanoserve.cache_stats(model)["num_blocks"] == 40


def test_from_config_door():
    stock = tiny_model("llama", seed=3)
    expected = generate(stock)
    door = AutoModelForCausalLM.from_config(stock.config, attn_implementation="nanoserve")
    door.load_state_dict(stock.state_dict())
    assert state_of(door) is not None
    assert torch.equal(generate(door.eval()), expected)


def test_the_patched_attentions_own_name_passes_the_door():
    """A loader given the patched models' attention name ("nanoserve_paged", registered once
    a model is patched), by hand or in the config of a model the door patched: the model is
    patched, not left running stock attention under that name. Found by a probe: the second
    ``from_config`` of a config the door had patched gave an unpatched model, silently.
    Planted: only "nanoserve" passing the door: failed."""
    stock = tiny_model("llama", seed=3)
    expected = generate(stock)
    config = stock.config
    first = AutoModelForCausalLM.from_config(config, attn_implementation="nanoserve")
    for model in (
        AutoModelForCausalLM.from_config(config),  # the config the door patched
        AutoModelForCausalLM.from_config(config, attn_implementation="nanoserve_paged"),
    ):
        assert state_of(model) is not None
        model.load_state_dict(stock.state_dict())
        assert torch.equal(generate(model.eval()), expected)
        nanoserve.unpatch_model(model)
    nanoserve.unpatch_model(first)


def test_a_model_built_under_the_name_without_the_door_refuses_to_run():
    """A model constructed directly under ``attn_implementation="nanoserve"`` was never
    patched: its first forward raises naming patch_model instead of running stock attention."""
    model = tiny_model("llama", attn_implementation="nanoserve")
    assert state_of(model) is None
    with pytest.raises(RuntimeError, match="nanoserve.patch_model"):
        generate(model)


def test_paged_config_mirrors_patch_model():
    """Every keyword of patch_model, with its default, is a PagedConfig field."""
    keywords = {
        name: p.default
        for name, p in inspect.signature(nanoserve.patch_model).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert nanoserve.PagedConfig().options() == keywords


def test_paged_config_is_checked():
    with pytest.raises(ValueError, match="^block_size"):
        nanoserve.PagedConfig(block_size=0)
    with pytest.raises(ValueError, match="^num_blocks, max_memory"):
        nanoserve.PagedConfig(num_blocks=4, max_memory=2**20)
    with pytest.raises(ValueError, match="^cuda_graphs"):
        nanoserve.PagedConfig(cuda_graphs=1)
    with pytest.raises(ValueError, match="^backend"):
        nanoserve.PagedConfig(backend="cuda")


def test_paged_config_needs_the_door(folder):
    with pytest.raises(ValueError, match="^paged_config.*attn_implementation"):
        AutoModelForCausalLM.from_pretrained(folder, paged_config=nanoserve.PagedConfig())
    with pytest.raises(ValueError, match="^paged_config.*PagedConfig"):
        AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="nanoserve", paged_config={"num_blocks": 4}
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_door_on_the_gpu(folder):
    """Loaded straight onto the GPU through the door: stock's float32 tokens, decode steps
    replayed from captured CUDA graphs."""
    stock = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda").eval()
    door = AutoModelForCausalLM.from_pretrained(
        folder, device_map="cuda", attn_implementation="nanoserve"
    ).eval()
    batch = {k: v.cuda() for k, v in padded_batch([3, 7, 5], 7, seed=11).items()}
    with torch.no_grad():
        expected = stock.generate(**batch, max_new_tokens=9, **GREEDY)
        assert torch.equal(door.generate(**batch, max_new_tokens=9, **GREEDY), expected)
    assert nanoserve.decode_graph_stats(door)["replays"] > 0
