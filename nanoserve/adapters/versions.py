"""The transformers releases the adapters support, checked when ``nanoserve.adapters`` is
imported (before anything of transformers' that may be missing in another release)."""

from __future__ import annotations

import importlib

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# transformers releases the adapters were written and tested against: [lowest, first unsupported)
SUPPORTED_TRANSFORMERS = ("5.17", "6")


class UnsupportedTransformers(ImportError, NotImplementedError):
    """The installed transformers is outside ``SUPPORTED_TRANSFORMERS`` (an ImportError when
    the adapters are imported; a NotImplementedError, as for an unsupported model, from
    ``patch_model``)."""


def check_transformers_version(version: str | None = None) -> None:
    """UnsupportedTransformers naming the supported range when ``version`` (default: the
    imported transformers') is outside it."""
    # looked up at each call: transformers replaces its module object in sys.modules as it
    # loads model classes lazily (every release has __version__ at its top level)
    version = version or importlib.import_module("transformers").__version__
    low, high = SUPPORTED_TRANSFORMERS
    # as pip reads ">=low,<high": a pre-release of ``high`` is outside, one of 5.x inside
    if not SpecifierSet(f">={low},<{high}").contains(version, prereleases=True):
        raise UnsupportedTransformers(
            f"nanoserve's adapters support transformers >= {low}, < {high}; this is {version} "
            f'(pip install "transformers>={low},<{high}")'
        )


def transformers_before(version: str) -> bool:
    """Whether the imported transformers is older than ``version``."""
    return Version(importlib.import_module("transformers").__version__) < Version(version)
