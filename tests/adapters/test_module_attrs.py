"""``module_attr`` reads what ``getattr(module, name, default)`` reads."""

from __future__ import annotations

import torch

from nanoserve.adapters.module_attrs import module_attr


class _Probe(torch.nn.Module):
    on_class = "class value"

    def __init__(self):
        super().__init__()
        self.own = 3
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("table", torch.zeros(2))
        self.child = torch.nn.Linear(2, 2)

    @property
    def computed(self):
        return self.own * 2


def test_same_as_getattr():
    probe = _Probe()
    for name in ("own", "on_class", "computed", "weight", "table", "child", "missing", "p"):
        assert module_attr(probe, name, "default") is getattr(probe, name, "default"), name
    assert module_attr(probe, "missing") is None
    assert module_attr(torch.nn.Dropout(0.25), "p") == 0.25
