"""The transformers releases the adapters support, checked when ``nanoserve.adapters`` is
imported (before anything of transformers' that may be missing in another release)."""

from __future__ import annotations

from importlib.metadata import version as installed_version

from packaging.version import Version

# transformers releases the adapters were written and tested against: [lowest, first unsupported)
SUPPORTED_TRANSFORMERS = ("5.17", "6")


class UnsupportedTransformers(ImportError):
    """The installed transformers is outside ``SUPPORTED_TRANSFORMERS``."""


def check_transformers_version(version: str | None = None) -> None:
    """UnsupportedTransformers naming the supported range when ``version`` (default: the
    installed transformers) is outside it."""
    version = version or installed_version("transformers")
    low, high = SUPPORTED_TRANSFORMERS
    if not Version(low) <= Version(version) < Version(high):
        raise UnsupportedTransformers(
            f"nanoserve's adapters support transformers >= {low}, < {high}; this is {version} "
            f'(pip install "transformers>={low},<{high}")'
        )
