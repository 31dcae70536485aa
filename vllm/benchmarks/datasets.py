"""Request samples for `vllm bench serve`: synthetic random tokens, ShareGPT, a JSONL file.

    --dataset-name random     prompts of --random-input-len random token ids (default)
    --dataset-name sharegpt   the first human turn of each conversation in --dataset-path
                              (the ShareGPT JSON layout), the reply's length as output length
    --dataset-name custom     one {"prompt": ...} object per line of --dataset-path (JSONL)

The names, flags and defaults are vLLM's (`vllm/benchmarks/datasets.py` there).
A random prompt is a list of token ids, sent as such to /v1/completions, so
its length is exact (vLLM decodes random ids to text and re-encodes it, which
can drift by a few tokens); for /v1/chat/completions it is decoded to text.
Lengths of ShareGPT and custom prompts are counted with the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm.benchmarks.utils import non_negative_int, positive_int

DATASETS = ("random", "sharegpt", "custom")
# vLLM's defaults; the flags default to None so that one given to another dataset is
# an error rather than silently unused.
RANDOM_DEFAULTS = {"random_input_len": 1024, "random_output_len": 128,
                   "random_range_ratio": 0.0, "random_prefix_len": 0}
CUSTOM_OUTPUT_LEN = 256
# The flags only one dataset reads.
_OWN_FLAGS = {"random": (*RANDOM_DEFAULTS, "input_len"), "sharegpt": ("sharegpt_output_len",),
              "custom": ("custom_output_len",)}


@dataclass
class SampleRequest:
    """One request to send."""

    prompt: str | list[int]  # text, or token ids (random prompts)
    prompt_len: int  # tokens
    expected_output_len: int  # max_tokens of the request


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags that this fork implements."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random",
                        help="Where prompts come from (see --dataset-path).")
    parser.add_argument("--dataset-path", default=None,
                        help="The ShareGPT JSON file (sharegpt) or JSONL file with a 'prompt' "
                             "field per line (custom); the random dataset takes none.")
    parser.add_argument("--input-len", type=positive_int, default=None,
                        help="Prompt tokens of the random dataset (another name of "
                             "--random-input-len).")
    parser.add_argument("--output-len", type=positive_int, default=None,
                        help="Output tokens of every request (sets --random-output-len, "
                             "--sharegpt-output-len or --custom-output-len).")
    group = parser.add_argument_group("random dataset")
    group.add_argument("--random-input-len", type=positive_int, default=None,
                       help=f"Tokens per prompt (default: {RANDOM_DEFAULTS['random_input_len']}).")
    group.add_argument("--random-output-len", type=positive_int, default=None,
                       help="Output tokens per request, max_tokens (default: "
                            f"{RANDOM_DEFAULTS['random_output_len']}).")
    group.add_argument("--random-range-ratio", type=unit_interval, default=None,
                       help="Lengths are drawn uniformly from [len * (1 - r), len * (1 + r)] "
                            "(default: 0).")
    group.add_argument("--random-prefix-len", type=non_negative_int, default=None,
                       help="Random tokens shared by every prompt, before its own (default: 0).")
    group = parser.add_argument_group("sharegpt dataset")
    group.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                       help="Output tokens per request (default: each reply's length).")
    group = parser.add_argument_group("custom dataset")
    group.add_argument("--custom-output-len", type=positive_int, default=None,
                       help=f"Output tokens per request (default: {CUSTOM_OUTPUT_LEN}).")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def validate_dataset_args(args: argparse.Namespace) -> None:
    """Raise ValueError (checked before any request; argparse has checked each value) for
    a dataset that needs a file and has none, a file the random dataset would not read,
    another dataset's flag, or one length given twice."""
    name = args.dataset_name
    for other, dests in _OWN_FLAGS.items():
        given = [d for d in dests if other != name and getattr(args, d) is not None]
        if given:
            raise ValueError(f"{_flag(given[0])} is a flag of --dataset-name {other}, "
                             f"not of {name}")
    if args.input_len is not None and args.random_input_len is not None:
        raise ValueError("--input-len and --random-input-len name the same length: give one")
    own_output = {"random": "random_output_len", "sharegpt": "sharegpt_output_len",
                  "custom": "custom_output_len"}[name]
    if args.output_len is not None and getattr(args, own_output) is not None:
        raise ValueError(f"--output-len and {_flag(own_output)} name the same length: give one")
    if name == "random":
        if args.dataset_path is not None:
            raise ValueError("--dataset-path is not read by --dataset-name random (the "
                             "default); choose sharegpt or custom")
        return
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    path = Path(args.dataset_path)
    if path.is_dir():
        raise ValueError(f"--dataset-path {args.dataset_path!r} is a directory, not a file")
    if not path.is_file():
        raise ValueError(f"--dataset-path {args.dataset_path!r}: no such file")


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """`args.num_prompts` requests of the chosen dataset.

    Raises:
        ValueError: the dataset file cannot be read or holds no usable prompt.
    """
    if args.dataset_name == "random":
        opts = {k: getattr(args, k) if getattr(args, k) is not None else v
                for k, v in RANDOM_DEFAULTS.items()}
        return random_samples(tokenizer, args.num_prompts,
                              args.input_len or opts["random_input_len"],
                              args.output_len or opts["random_output_len"],
                              opts["random_range_ratio"], opts["random_prefix_len"], args.seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_samples(args.dataset_path, tokenizer, args.num_prompts,
                                args.output_len or args.sharegpt_output_len, args.seed)
    return custom_samples(args.dataset_path, tokenizer, args.num_prompts,
                          args.output_len or args.custom_output_len or CUSTOM_OUTPUT_LEN,
                          args.seed)


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, int(length * (1.0 - ratio))), max(1, int(length * (1.0 + ratio)))


def random_samples(tokenizer, num: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0
                   ) -> list[SampleRequest]:
    """`num` prompts of random token ids (special tokens excluded): a shared prefix of
    `prefix_len` ids, then a length drawn from input_len x [1 - r, 1 + r]; output
    lengths likewise from output_len."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    prefix = [rng.choice(ids) for _ in range(prefix_len)]
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    samples = []
    for _ in range(num):
        prompt = prefix + [rng.choice(ids) for _ in range(rng.randint(in_lo, in_hi))]
        samples.append(SampleRequest(prompt, len(prompt), rng.randint(out_lo, out_hi)))
    return samples


def _read_json(path: str, what: str):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r} is not a {what} file: {e}") from None


def sharegpt_samples(path: str, tokenizer, num: int, output_len: int | None, seed: int = 0
                     ) -> list[SampleRequest]:
    """The first human turn of conversations in a ShareGPT JSON file ([{"conversations":
    [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]),
    shuffled with `seed`. As vLLM, without a fixed output length, pairs whose prompt or
    reply is under 4 tokens, prompt over 1024 or both over 2048 are skipped."""
    data = _read_json(path, "ShareGPT JSON")
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path!r}: a ShareGPT file is a JSON list")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if (isinstance(turns, list) and len(turns) >= 2
                and all(isinstance(t, dict) and isinstance(t.get("value"), str)
                        for t in turns[:2])):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    samples = []
    filtered = 0
    for prompt, reply in pairs:
        if len(samples) == num:
            break
        prompt_len = len(tokenizer(prompt).input_ids)
        if output_len is None:
            reply_len = len(tokenizer(reply).input_ids)
            if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or (
                    prompt_len + reply_len > 2048):
                filtered += 1
                continue
        samples.append(SampleRequest(prompt, prompt_len, output_len or reply_len))
    if not samples and filtered:
        raise ValueError(
            f"--dataset-path {path!r}: all {filtered} conversations were filtered out (a "
            "prompt or reply under 4 tokens, a prompt over 1024 or both over 2048, as vLLM); "
            "--sharegpt-output-len keeps them")
    return _enough(samples, num, path)


def custom_samples(path: str, tokenizer, num: int, output_len: int, seed: int = 0
                   ) -> list[SampleRequest]:
    """Prompts from a JSONL file, one {"prompt": "..."} object per line, shuffled with `seed`."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r} cannot be read: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--dataset-path {path!r} line {number}: expected a JSON object "
                             "with a 'prompt' string") from None
        if not isinstance(prompt, str):
            raise ValueError(f"--dataset-path {path!r} line {number}: 'prompt' is not a string")
        prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    samples = [SampleRequest(p, len(tokenizer(p).input_ids), output_len) for p in prompts[:num]]
    return _enough(samples, num, path)


def _enough(samples: list[SampleRequest], num: int, path: str) -> list[SampleRequest]:
    """Repeat the samples cyclically up to `num` (vLLM oversamples the same way)."""
    if not samples:
        raise ValueError(f"--dataset-path {path!r} holds no usable prompt")
    return [samples[i % len(samples)] for i in range(num)]
