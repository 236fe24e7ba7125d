"""Real peft models on a patched base: tokens equal to an unpatched copy's, call after call
(adapters switched, trained and dropping out), or a clear refusal before anything changes.

The README's way in: ``nanoserve.patch_model(peft_model.get_base_model())``, then the
wrapper's ``generate`` as before.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import patched, sharpen
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.step import state_of

peft = pytest.importorskip("peft")  # (in the test extras; a GPU box may lack it)

GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


def with_peft(config, seed: int = 0):
    """A tiny sharpened Llama wrapped by ``get_peft_model(config)``, every trainable value
    redrawn (peft starts LoRA's B and prompt embeddings where they change little)."""
    model = peft.get_peft_model(sharpen(tiny_model("llama", seed=seed)), config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


def calls_agree(wrapped, calls, replays=None, **kwargs) -> tuple[list[str], list[str]]:
    """Runs each ``calls`` entry (a function of the wrapper run before its call, or None) on
    ``wrapped`` patched at its base and on a deep copy of it unpatched, seeded alike. Returns
    the calls whose sequences differ, described, and the loop each patched call ran (the
    decode graphs' replays so far appended to ``replays``)."""
    replays = [] if replays is None else replays
    stock = copy.deepcopy(wrapped)
    differ, loops = [], []
    with patched(wrapped.get_base_model(), num_blocks=64):
        for number, before in enumerate(calls):
            outs = []
            for model in (stock, wrapped):
                if before is not None:
                    before(model)
                torch.manual_seed(number)
                with torch.no_grad():
                    outs.append(model.generate(**kwargs))
            if not torch.equal(*outs):
                differ.append(f"call {number}: {outs[0].tolist()} != {outs[1].tolist()}")
            stats = nanoserve.decode_graph_stats(wrapped.get_base_model())
            loops.append(stats["decode_loop"])
            replays.append(stats["replays"])
    return differ, loops


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_runs_stocks_generate(method):
    """peft's prompt learning sets ``prepare_inputs_for_generation`` on the base model for
    its call: virtual tokens ahead of the prompt (prompt and P-tuning), or a cache of its own
    (prefix tuning). A patched base runs stock's generate for such a call, left-padded rows
    too (the virtual tokens' mask columns come before the padding). Planted: the paged
    cache taking the call (``steps_set_on_instance`` answering None) gave other tokens from
    the second new one at batch 1 (the positions left out the virtual tokens), refused the
    left-padded batches ("padding after a real token": peft's ones before the padding), and
    on transformers 5.17 prefix tuning raised an AttributeError (peft's DynamicCache in the
    loop)."""
    configs = {
        "prompt_tuning": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6),
        "p_tuning": peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=6, encoder_hidden_size=32
        ),
        "prefix_tuning": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6),
    }
    wrapped = with_peft(configs[method])
    differ, loops = [], []
    for batch, options in [
        (padded_batch([24], 24), GREEDY),
        (padded_batch([24, 17, 9], 24), GREEDY),
        (padded_batch([24, 17, 9], 24), {**GREEDY, "do_sample": True}),
    ]:
        found, ran = calls_agree(wrapped, [None, None], **batch, **options)
        differ, loops = differ + found, loops + ran
    assert not differ, differ
    assert all(loop.startswith("stock") for loop in loops), loops


def test_lora_adapters_switched_trained_and_merged_between_calls():
    """Two LoRA adapters over q/k/v/o and the MLP: switched between calls, one disabled, a
    training step on one, merged and unmerged, each call's prompt the same (a prefix of it
    cached by the calls before). Every call equals the unpatched copy's. Planted: the salt
    leaving out the tuner layers' switches (``_adapters_on`` returning ()) failed the call
    after the first switch."""
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    wrapped = with_peft(peft.LoraConfig(**lora))
    wrapped.add_adapter("second", peft.LoraConfig(**lora))
    batch = padded_batch([40, 33], 40)

    def train_step(model):
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        ids = batch["input_ids"][:, -20:]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()

    calls = [
        None,
        lambda m: m.set_adapter("second"),
        lambda m: m.set_adapter("default"),
        lambda m: m.base_model.disable_adapter_layers(),
        lambda m: m.base_model.enable_adapter_layers(),
        train_step,
        lambda m: m.merge_adapter(),
        lambda m: m.unmerge_adapter(),
    ]
    differ, loops = calls_agree(wrapped, calls, **batch, **GREEDY)
    assert not differ, differ
    assert loops == ["nanoserve"] * len(calls), loops


@pytest.mark.parametrize("method", ["loha", "lokr", "oft"])
def test_tuner_dropout_in_training_mode_shares_nothing(method):
    """LoHa and LoKr keep their dropout rates in dicts (one per adapter), OFT in a module of
    peft's own (``MultiplicativeDropoutLayer``, rate ``p``): in training mode such a model
    draws other dropout for each copy of a prompt, so nothing is shared, within a call or
    across calls. Planted: the rates in dicts left unread failed loha and lokr at the second
    call (a cached prefix served); the module's ``p`` left unread, oft ran nanoserve's loop
    and shared (its tokens happened to be stock's here, so the loop is checked too)."""
    target = ["q_proj", "k_proj", "v_proj"]
    configs = {
        "loha": peft.LoHaConfig(r=4, target_modules=target, rank_dropout=0.5, module_dropout=0.5),
        "lokr": peft.LoKrConfig(r=4, target_modules=target, rank_dropout=0.5, module_dropout=0.5),
        "oft": peft.OFTConfig(oft_block_size=16, target_modules=target, module_dropout=0.5),
    }
    wrapped = with_peft(configs[method]).train()
    batch = padded_batch([30, 30], 30)
    batch["input_ids"][1] = batch["input_ids"][0]  # one prompt twice
    differ, loops = calls_agree(wrapped, [None] * 3, **batch, **{**GREEDY, "do_sample": True})
    assert not differ, differ
    assert all(loop.startswith("stock: ") and "drops out" in loop for loop in loops), loops


def test_layer_replication_refused_before_patching():
    """peft's ``layer_replication`` deep-copies each layer, configs too: patching such a base
    would leave its attention on sdpa, reading the paged pools as its cache (a RuntimeError
    inside a call). ``patch_model`` refuses first, naming the module, and changes nothing;
    replicated after patching, generate refuses the same way. Planted: the check removed,
    the call failed inside sdpa ("Number of heads in key and value")."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], layer_replication=[(0, 2), (1, 2)])
    wrapped = with_peft(config)
    base = wrapped.get_base_model()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.config: a config object"):
        nanoserve.patch_model(base)
    assert state_of(base) is None and base.config._attn_implementation == "sdpa"
    assert "forward" not in vars(base) and "generate" not in vars(base)

    plain = tiny_model("llama")
    with patched(plain):
        later = peft.get_peft_model(plain, config)
        with pytest.raises(ValueError, match=r"\.self_attn\.config: a config object"):
            later.generate(**padded_batch([12], 12), **GREEDY)


def test_padding_between_real_tokens_runs_stocks_generate():
    """A mask with padding between real tokens, every row ending with a real one (a
    caller masking tokens out of a prompt): stock attends around the holes, the paged
    cache cannot hold them, so the call runs stock's generate. Padding at a row's end
    (right padding) is still refused. Planted: the fallback removed, the call raised
    "padding after a real token"."""
    model = sharpen(tiny_model("llama"))
    batch = padded_batch([20, 14], 20)
    batch["attention_mask"][0, 5:8] = 0
    stock_model = copy.deepcopy(model)
    with torch.no_grad():
        stock = stock_model.generate(**batch, **GREEDY)
    with patched(model), torch.no_grad():
        assert torch.equal(model.generate(**batch, **GREEDY), stock)
        loop = nanoserve.decode_graph_stats(model)["decode_loop"]
        assert loop.startswith("stock"), loop
        right = padded_batch([20, 14], 20)
        right["attention_mask"][1] = right["attention_mask"][1].flip(0)
        with pytest.raises(ValueError, match="attention_mask: padding after a real token"):
            model.generate(**right, **GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_on_cuda_in_graph_steps():
    """LoRA over every linear layer on CUDA (float32): the decode steps replay CUDA graphs
    (peft's layers are not plain ``nn.Linear``, so no fused projections) and each call,
    adapters switched and disabled between them, gives the unpatched copy's tokens."""
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    wrapped = with_peft(peft.LoraConfig(**lora)).to("cuda")
    wrapped.add_adapter("second", peft.LoraConfig(**lora))
    wrapped.to("cuda")
    batch = {k: v.to("cuda") for k, v in padded_batch([40, 33, 7], 40).items()}
    calls = [
        None,
        lambda m: m.set_adapter("second"),
        lambda m: m.set_adapter("default"),
        lambda m: m.base_model.disable_adapter_layers(),
    ]
    replays = []
    differ, loops = calls_agree(
        wrapped, calls, replays, **batch, **{**GREEDY, "max_new_tokens": 24}
    )
    assert not differ, differ
    assert loops == ["nanoserve"] * len(calls), loops
    assert replays[-1] > 0, replays
