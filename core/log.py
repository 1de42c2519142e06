"""The ``vllm_ir`` logger: silent by default, ``VLLM_IR_LOG_LEVEL=DEBUG`` turns it on.

Everything vllm-ir logs goes through the standard `logging` module under the ``vllm_ir``
logger (children such as ``vllm_ir.dispatch``), so an application's own logging set-up
applies. Only slow paths log (cache misses, plugin loading, lowering); the eager cache-hit
path never does.
"""

from __future__ import annotations

import logging
import os

ENV_LOG_LEVEL = "VLLM_IR_LOG_LEVEL"
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")

logger = logging.getLogger("vllm_ir")
logger.addHandler(logging.NullHandler())
_handler: logging.Handler | None = None


def get_logger(name: str) -> logging.Logger:
    """A child of the ``vllm_ir`` logger, e.g. ``get_logger("dispatch")``."""
    return logger.getChild(name)


def configure_from_env() -> None:
    """Apply ``VLLM_IR_LOG_LEVEL`` (unset: leave logging to the application).

    A set level attaches one stderr handler to the ``vllm_ir`` logger; a malformed value is a
    warning on that logger's last-resort handler, never an import error.
    """
    global _handler
    raw = os.environ.get(ENV_LOG_LEVEL, "").strip().upper()
    if not raw:
        return
    if raw not in LEVELS:
        logging.getLogger("vllm_ir").warning(
            "%s=%r is not a log level; expected one of %s", ENV_LOG_LEVEL, raw, ", ".join(LEVELS)
        )
        return
    logger.setLevel(raw)
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_handler)
