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

    A set level attaches one stderr handler to the ``vllm_ir`` logger; a malformed value is
    ignored as any malformed setting is (`vllm_ir.settings.env`): one `ConfigWarning` and a ``vllm-ir
    doctor`` problem, never an import error (a log record would go nowhere: the logger is silent).
    """
    global _handler
    value = os.environ.get(ENV_LOG_LEVEL, "")
    raw = value.strip().upper()
    if not raw:
        return
    if raw not in LEVELS:
        from vllm_ir.settings import env  # only for the mistake: keeps `import vllm_ir` lean

        message = f"{ENV_LOG_LEVEL}={value!r} is not a log level; accepted: {', '.join(LEVELS)} (any case)"
        hint = env.did_you_mean(raw, LEVELS)
        fix = f"set {ENV_LOG_LEVEL}=DEBUG or unset it"
        env.report("log", [env.Finding(ENV_LOG_LEVEL, f"{message}{hint}; it is ignored", fix)])
        return
    logger.setLevel(raw)
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_handler)
