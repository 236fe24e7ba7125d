"""The dense and mixture-of-experts families of ``dense.py`` and ``moe.py`` on the paged cache:
tiny random-weight models in float32 on the CPU, token- and logit-exact with stock, windows
(8 tokens, blocks of 4) shorter than the prompts where the family has them; and on a CUDA GPU,
real head dims through the Triton kernels and the decode graphs."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    NEEDS_INTERPRETER,
    check_launches,
    count_triton_launches,
    patched,
    sharpen,
    stock_and_paged,
)
from test_families import SMALL, padded_batch
from test_new_families import assert_logits_equal

import nanoserve
from nanoserve.adapters import family_for, supported_model_types

WINDOW = 8
EXPERTS = dict(num_experts_per_tok=2)
# name: (config class, model class, config fields beyond SMALL)
CONFIGS = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, sliding_window=WINDOW, **EXPERTS),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            **EXPERTS,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=32, head_dim=16, **EXPERTS),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, **EXPERTS)),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(num_local_experts=4, attention_multiplier=0.3, **EXPERTS),
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(num_local_experts=4, shared_intermediate_size=32, **EXPERTS),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            n_routed_experts=4,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            head_dim=16,
            n_group=1,
            topk_group=1,
            **EXPERTS,
        ),
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=32,
            head_dim=16,
            moe_layer_start_index=1,
        ),
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(num_experts=4, moe_topk=2, head_dim=16),
    ),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=WINDOW)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            attention_multiplier=0.3,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            logits_scaling=4.0,
        ),
    ),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(sliding_window=WINDOW, num_hidden_layers=4),
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict()),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=16)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16)),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16),
    ),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(sliding_window=WINDOW, sliding_window_pattern=2),
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.5)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=16)),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict()),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict()),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16)),
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(partial_rotary_factor=0.5, head_dim=16),
    ),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=16)),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict()),
}
WINDOWED = ["mixtral", "qwen2_moe", "olmo3", "starcoder2", "cohere2", "ministral", "exaone4"]
GREEDY = dict(do_sample=False, eos_token_id=None)
LOGITS = dict(output_logits=True, return_dict_in_generate=True, **GREEDY)


def tiny_model(name: str, seed: int = 0, **overrides):
    """A random-weight model of ``name`` (a CONFIGS key), its matrices drawn large."""
    config_name, model_name, extra = CONFIGS[name]
    with warnings.catch_warnings():  # e.g. SMALL's vocabulary is under a config's default ids
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    return sharpen(getattr(transformers, model_name)(config).eval())


def test_registry_names_every_family():
    """Each model type is served, by the dense or the MoE family."""
    for name, (config_name, _, _) in CONFIGS.items():
        model_type = getattr(transformers, config_name).model_type
        assert model_type in supported_model_types(), name
        assert family_for(getattr(transformers, config_name)()).name in ("dense", "moe")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_step_logits_match_stock(name):
    """A left-padded batch of prompts of 19, 11 and 4 tokens, 14 greedy steps: stock's tokens
    and per-step logits; the windowed families run past their window of 8."""
    model = tiny_model(name)
    inputs = padded_batch([19, 11, 4], 19)
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=14, **LOGITS, patch_options={"block_size": 4}
    )
    assert_logits_equal(stock, paged)


@pytest.mark.parametrize("name", WINDOWED)
def test_windows_move_stock(name):
    """What the windowed cases above hold the paged path to is not trivial: a window of 64
    instead of 8 moves stock's logits (a paged model ignoring the window would differ)."""
    inputs = padded_batch([19], 19)

    def logits(**overrides):
        with torch.no_grad():
            out = tiny_model(name, **overrides).generate(**inputs, max_new_tokens=4, **LOGITS)
        return torch.stack(out.logits)

    assert (logits() - logits(sliding_window=64)).abs().amax() > 1e-3


MODES = {
    "beams": dict(num_beams=3, num_return_sequences=2, **GREEDY),
    "sampling": dict(do_sample=True, top_k=20, num_return_sequences=3, eos_token_id=None),
    "chunked": dict(prefill_chunk_size=5, **GREEDY),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmo3", "exaone4", "gpt_neox"])
def test_generate_modes_match_stock(name, mode):
    """Beams, seeded sampling with copies of each prompt, and chunked prefill; two rows
    repeat one prompt, so its prefill runs once (prefix sharing)."""
    model = tiny_model(name)
    inputs = padded_batch([13, 6, 13], 13)
    inputs["input_ids"][2] = inputs["input_ids"][0]
    stock, paged = stock_and_paged(
        model, seed=3, **inputs, max_new_tokens=12, **MODES[mode], patch_options={"block_size": 4}
    )
    assert torch.equal(stock, paged)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["mixtral", "cohere2"])
def test_triton_kernels_match_stock(name, monkeypatch):
    """The Triton kernels under the interpreter: a window on every layer (Mixtral: blocks
    out of it are released) and sliding layers mixed with global ones (Cohere 2: two pools)."""
    model = tiny_model(name)
    inputs = padded_batch([19, 4], 19)
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=10, **LOGITS,
        patch_options={"block_size": 4, "backend": "triton"},
    )  # fmt: skip
    check_launches(launches, "triton")
    assert_logits_equal(stock, paged)
    stats = paged.past_key_values.stats()
    if name == "mixtral":
        assert stats["blocks_dropped_by_window"] > 0
    else:
        assert "group1_blocks_used" in stats


@pytest.mark.parametrize("layer_type", ["chunked_attention", "linear_attention"])
def test_unknown_layer_types_are_refused(layer_type):
    """A layer type the paged kernels do not compute is refused at patch_model, naming it,
    and the model is left as it was."""
    model = tiny_model("olmo3")
    model.config.layer_types = [layer_type] + model.config.layer_types[1:]
    with pytest.raises(NotImplementedError, match=layer_type):
        nanoserve.patch_model(model)
    assert "generate" not in model.__dict__


def test_exaone4_layer_type_changed_is_refused():
    """EXAONE 4's attention holds the window on every layer and passes it where it was built
    sliding (``is_sliding``): a global layer holding a window is fine (the cases above), but
    layer types changed in the config after the model was built are refused at patch_model,
    since stock's masks would follow the config and the modules their own. Planted: the
    is_sliding branch of check_windows removed: test_per_step_logits_match_stock[exaone4] was
    refused."""
    model = tiny_model("exaone4")
    assert model.config.layer_types[1] == "full_attention"
    model.config.layer_types = ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="config.layer_types: layer 1 is 'sliding_attention'"):
        nanoserve.patch_model(model)
    assert "generate" not in model.__dict__


@pytest.mark.parametrize("name", ["mixtral", "cohere2"])
def test_tensor_parallel_matches_one_process(name, tmp_path):
    """Two gloo ranks on the CPU, the model loaded with transformers' ``tp_plan="auto"``
    (Mixtral's experts and attention sharded; Cohere 2's sliding and global layers in two
    pools): the patched model's tokens equal stock's under the same sharding and one
    process's, and each rank's pool holds half the KV heads. (Planted: this rank's layout
    left at every KV head: still passed, the pools take their width from the K written.)"""
    from tp_family_worker import prompts

    model = tiny_model(name, vocab_size=104, intermediate_size=128)
    model.save_pretrained(tmp_path / "model")
    ids, mask = prompts(104)
    with torch.no_grad():
        one = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **GREEDY)
    worker = Path(__file__).with_name("tp_family_worker.py")
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    cmd = [*launcher, str(worker), str(tmp_path / "model"), str(tmp_path / "seen.json")]
    # (faulthandler: a rank that aborts natively prints its Python stack)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["stock"] == one.tolist()
    assert seen["paged"] == seen["stock"]
    assert seen["pool_kv_heads"] == model.config.num_key_value_heads // 2


def test_continuing_shared_rows_past_the_window_grows_the_pool_enough():
    """Four copies of a 30-token prompt (blocks of 2, every layer sliding within 8): the rows
    share the prompt's 15 blocks. Passed back with 5 more tokens each, the rows release the
    shared blocks out of the window together and each then holds blocks of its own, so the
    pool must grow by those, not by what it would need were the shared blocks each row's
    alone. Planted: ``blocks_to_continue`` subtracting each row's held blocks (the shared
    ones once per row): OutOfBlocks (a fuzz run found it, Mixtral with 12 such rows)."""
    model = tiny_model("mixtral")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt = padded_batch([30], 30, seed=5)["input_ids"].repeat(4, 1)
    more = torch.randint(3, 97, (4, 5), generator=torch.Generator().manual_seed(6))
    opts = dict(return_dict_in_generate=True, **GREEDY)

    def two_calls():
        first = model.generate(input_ids=prompt, max_new_tokens=1, **opts)
        ids = torch.cat([first.sequences, more], 1)
        kept = {name: first.past_key_values}
        return model.generate(input_ids=ids, max_new_tokens=8, **opts, **kept)

    with torch.no_grad():
        stock = two_calls()
        with patched(model, block_size=2):
            paged = two_calls()
    assert paged.past_key_values.stats()["blocks_dropped_by_window"] > 0
    assert torch.equal(paged.sequences, stock.sequences)
