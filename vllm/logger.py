"""One logging setup for the package: `init_logger(__name__)` in every module.

Format and level follow vLLM's (`VLLM_LOGGING_LEVEL`, default INFO).
"""

import logging
import os
import sys

_ROOT = "vllm"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )
    )
    root.addHandler(handler)


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    return logging.getLogger(name)
