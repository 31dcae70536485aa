"""The offline engine of `vllm bench latency|throughput`, from `vllm serve`'s engine flags."""

from __future__ import annotations

import argparse
import dataclasses


def make_llm(args: argparse.Namespace, max_num_seqs_at_least: int = 0):
    """An `LLM` from the parsed engine flags.

    max_num_seqs is the flag's value when given; unset, it is the engine's
    default for the device (`default_limits`: 256 on CUDA, 64 on CPU), or
    `max_num_seqs_at_least` (a batch that must run as one) when that is
    larger, as vLLM's `bench latency` leaves the engine default unless the
    batch needs more.

    Raises:
        ValueError / FileNotFoundError: a bad flag value or model path (naming it).
        EngineStartupError: what the engine refused while it started (a KV
            cache the device cannot hold: exit code 1; `vllm serve`'s mapping,
            `startup_errors`).
        DeviceBusyError: another process holds the device.
    """
    from vllm.config.scheduler import default_limits
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM
    from vllm.platforms import current_platform
    from vllm.v1.engine.exceptions import startup_errors

    engine_args = EngineArgs.from_cli_args(args)
    default_seqs, _ = default_limits(current_platform.device_type)
    if engine_args.max_num_seqs is None and max_num_seqs_at_least > default_seqs:
        engine_args = dataclasses.replace(engine_args, max_num_seqs=max_num_seqs_at_least)
    engine_args.validate()
    kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    with startup_errors():
        return LLM(**kwargs)
