"""One logging setup for the package: `init_logger(__name__)` in every module.

Format and level follow vLLM's (`VLLM_LOGGING_LEVEL`, default INFO;
`VLLM_CONFIGURE_LOGGING=0` adds no handler: see vllm/envs.py).
"""

import logging
import sys

from vllm import envs

_ROOT = "vllm"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    root.setLevel(envs.VLLM_LOGGING_LEVEL)
    if not envs.VLLM_CONFIGURE_LOGGING:
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


class _ProcessLabel(logging.Filter):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"({self.label}) {record.msg}"
        return True


def set_process_label(label: str) -> None:
    """Prefix this process's vllm log lines with "(label)", e.g. "(worker rank 1 pid 345)".

    For processes whose lines interleave with others' on the same output
    (worker and engine core processes), as vLLM does.
    """
    _configure_root()
    # On the handlers: a logger's own filters do not see its children's records.
    for handler in logging.getLogger(_ROOT).handlers:
        for existing in [f for f in handler.filters if isinstance(f, _ProcessLabel)]:
            handler.removeFilter(existing)
        handler.addFilter(_ProcessLabel(label))
