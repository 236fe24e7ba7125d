"""Random interleavings of generate calls on one patched model (hypothesis): mixed batch
sizes, greedy / seeded sampling / beams, float32 / float64, re-patching with a pool too
small (OutOfBlocks mid-call), the Triton kernels under the interpreter, and continuation
of returned caches. After every call the tokens equal those of a stock twin of the model,
or the call raised OutOfBlocks where the pool was fixed too small."""

from __future__ import annotations

import copy
import os

import torch
from helpers import cache_name
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from test_families import padded_batch, tiny_model

import nanoserve

BACKENDS = ["auto", "torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "beams": dict(do_sample=False, num_beams=2),
}


class GenerateCalls(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = tiny_model("llama")
        self.stock = copy.deepcopy(self.model)  # never patched: the reference
        self.num_blocks = None
        self.backend = "auto"
        nanoserve.patch_model(self.model, block_size=4)
        self.returned = None  # (inputs, paged output, stock output) of a kept call
        self.cache_name = cache_name(self.model)

    def both(self, seed: int, **kwargs):
        """(paged, stock) outputs of one generate call; paged is None where the paged call
        may refuse: OutOfBlocks from a pool fixed too small, Triton forced on float64."""
        with torch.no_grad():
            torch.manual_seed(seed)
            expected = self.stock.generate(**kwargs)
            torch.manual_seed(seed)
            try:
                return self.model.generate(**kwargs), expected
            except (nanoserve.OutOfBlocks, ValueError) as error:
                self.check_refusal(error)
                return None, expected

    def check_refusal(self, error: Exception, pool_fixed: bool = False) -> None:
        """``pool_fixed``: a returned cache's pool was fixed by the patch that made it, which
        a later re-patch does not change (README)."""
        if isinstance(error, nanoserve.OutOfBlocks):
            fixed = self.num_blocks is not None or pool_fixed
            assert fixed, "OutOfBlocks with a pool sized by the call"
        else:
            assert self.backend == "triton" and self.model.dtype == torch.float64, error
            assert str(error).startswith("backend: "), error

    @rule(
        lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
        new=st.integers(1, 6),
        mode=st.sampled_from(sorted(MODES)),
        keep=st.booleans(),
        seed=st.integers(0, 1000),
    )
    def generate(self, lengths, new, mode, keep, seed):
        inputs = padded_batch(lengths, max(lengths), seed=seed)
        opts = dict(max_new_tokens=new, eos_token_id=None, **MODES[mode])
        if keep:
            opts["return_dict_in_generate"] = True
        out, expected = self.both(seed, **inputs, **opts)
        if out is None:
            return
        tokens = out.sequences if keep else out
        want = expected.sequences if keep else expected
        assert torch.equal(tokens, want), (mode, lengths, new)
        if keep and mode != "beams":
            self.returned = (inputs, out, expected)

    @precondition(lambda self: self.returned is not None)
    @rule(new=st.integers(1, 5), seed=st.integers(0, 1000))
    def continue_returned(self, new, seed):
        inputs, out, expected = self.returned
        self.returned = None  # a continued cache has moved on (stock's too)
        cache = out.past_key_values
        pool = next((p for p in cache.paged.key_pools if p is not None), None)
        mask = inputs["attention_mask"]
        grown = torch.ones(mask.shape[0], out.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)
        kwargs = dict(
            input_ids=out.sequences,
            attention_mask=torch.cat([mask, grown], dim=1),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
        )
        if pool is not None and pool.dtype != self.model.dtype:
            lens = cache.paged.seq_lens()
            try:
                with torch.no_grad():
                    self.model.generate(**kwargs, **{self.cache_name: cache})
            except nanoserve.OutOfBlocks as error:
                # a fixed pool too small for the continuation refuses first (blocks are
                # reserved before the layers see the dtype): as clean, nothing changed
                self.check_refusal(error, cache.pool_fixed)
            except ValueError as error:
                assert str(error).startswith("key: ")
            else:
                raise AssertionError("a dtype change under a returned cache did not raise")
            assert cache.paged.seq_lens() == lens
            return
        with torch.no_grad():
            want = self.stock.generate(**kwargs, **{self.cache_name: expected.past_key_values})
            try:
                got = self.model.generate(**kwargs, **{self.cache_name: cache})
            except (nanoserve.OutOfBlocks, ValueError) as error:
                self.check_refusal(error, cache.pool_fixed)
                return
        assert torch.equal(got, want)

    @rule(dtype=st.sampled_from([torch.float32, torch.float64]))
    def change_dtype(self, dtype):
        self.model.to(dtype)
        self.stock.to(dtype)

    @rule(num_blocks=st.one_of(st.none(), st.integers(2, 10)), backend=st.sampled_from(BACKENDS))
    def repatch(self, num_blocks, backend):
        self.num_blocks, self.backend = num_blocks, backend
        nanoserve.patch_model(self.model, block_size=4, num_blocks=num_blocks, backend=backend)

    def teardown(self):
        nanoserve.unpatch_model(self.model)


GenerateCalls.TestCase.settings = settings(
    max_examples=25, stateful_step_count=8, deadline=None, derandomize=False
)
test_generate_calls_interleaved = GenerateCalls.TestCase
