"""The offline engine of `vllm bench latency|throughput`, from `vllm serve`'s engine flags."""

from __future__ import annotations

import argparse
import dataclasses


def make_llm(args: argparse.Namespace, max_num_seqs_at_least: int = 0):
    """An `LLM` from the parsed engine flags; max_num_seqs raised to the batch if unset.

    Raises:
        ValueError / FileNotFoundError: a bad flag value or model path (naming it).
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_num_seqs is None and max_num_seqs_at_least:
        engine_args = dataclasses.replace(engine_args, max_num_seqs=max_num_seqs_at_least)
    engine_args.validate()
    kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    return LLM(**kwargs)
