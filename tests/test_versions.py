"""The supported transformers range is checked when the adapters are imported: outside it,
``import nanoserve`` warns and keeps the cache and kernels; the adapters refuse to import,
naming the range."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nanoserve.adapters.versions import (
    SUPPORTED_TRANSFORMERS,
    UnsupportedTransformers,
    check_transformers_version,
)


@pytest.mark.parametrize("version", ["5.17.0", "5.24.0", "5.25.0", "5.99.1"])
def test_inside_the_range(version):
    check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.3", "5.16.2", "6.0.0", "6.0.0.dev0"])
def test_outside_the_range(version):
    low, high = SUPPORTED_TRANSFORMERS
    with pytest.raises(UnsupportedTransformers, match=f">= {low}, < {high}; this is {version}"):
        check_transformers_version(version)
    assert issubclass(UnsupportedTransformers, ImportError)  # at the adapters' import
    assert issubclass(UnsupportedTransformers, NotImplementedError)  # from patch_model


SCRIPT = textwrap.dedent(
    """
    import warnings
    import transformers
    transformers.__version__ = "4.57.3"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import nanoserve
    assert any("4.57.3" in str(w.message) for w in caught), [str(w.message) for w in caught]
    from nanoserve import PagedKVCache  # the cache still works
    PagedKVCache(num_layers=1, num_blocks=4, block_size=4)
    from transformers import AttentionInterface
    assert "nanoserve" not in AttentionInterface._global_mapping  # the door stays shut
    try:
        nanoserve.patch_model
    except ImportError as error:
        assert type(error).__name__ == "UnsupportedTransformers", error
        assert ">= 5.17, < 6; this is 4.57.3" in str(error), error
    else:
        raise AssertionError("patch_model imported on an unsupported transformers")
    print("OK")
    """
)


def test_import_on_an_unsupported_transformers():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr
