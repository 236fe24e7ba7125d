"""The transformers releases the adapters support, checked when ``nanoserve.adapters`` is
imported (before anything of transformers' that may be missing in another release)."""

from __future__ import annotations

from importlib.metadata import version as installed_version

from packaging.specifiers import SpecifierSet

# transformers releases the adapters were written and tested against: [lowest, first unsupported)
SUPPORTED_TRANSFORMERS = ("5.17", "6")


class UnsupportedTransformers(ImportError):
    """The installed transformers is outside ``SUPPORTED_TRANSFORMERS``."""


def check_transformers_version(version: str | None = None) -> None:
    """UnsupportedTransformers naming the supported range when ``version`` (default: the
    installed transformers) is outside it."""
    version = version or installed_version("transformers")
    low, high = SUPPORTED_TRANSFORMERS
    # as pip reads ">=low,<high": a pre-release of ``high`` is outside, one of 5.x inside
    if not SpecifierSet(f">={low},<{high}").contains(version, prereleases=True):
        raise UnsupportedTransformers(
            f"nanoserve's adapters support transformers >= {low}, < {high}; this is {version} "
            f'(pip install "transformers>={low},<{high}")'
        )
