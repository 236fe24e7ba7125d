"""The ``nanoserve`` logger: what nanoserve decided (pool sizes and why, CUDA graphs captured
per batch bucket, fallbacks taken, prefixes found in the cache).

Quiet by default (INFO records are dropped, as for any library logger without a handler,
unless the application sets the root logger to INFO, e.g. ``logging.basicConfig``).
``NANOSERVE_LOG=info`` (or ``debug``, ``warning``) in the environment prints them on stderr
from ``import nanoserve`` on; the logging module works as usual
(``logging.getLogger("nanoserve").setLevel(logging.INFO)`` with a handler of your own).
"""

from __future__ import annotations

import logging
import os
import warnings

ROOT = "nanoserve"
ENV = "NANOSERVE_LOG"


def get_logger(module: str) -> logging.Logger:
    """The logger of a nanoserve module (a child of the ``nanoserve`` logger)."""
    name = module if module.startswith(ROOT) else f"{ROOT}.{module}"
    return logging.getLogger(name)


def configure_from_env(environ=None) -> None:
    """``NANOSERVE_LOG=<level>``: the ``nanoserve`` logger at that level, printing on stderr
    (one handler, added once). A level logging lacks is warned about and ignored."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        warnings.warn(f"{ENV}: unknown level {value!r} (debug, info, warning, error)", stacklevel=2)
        return
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(getattr(h, "nanoserve_env", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        handler.nanoserve_env = True
        logger.addHandler(handler)
