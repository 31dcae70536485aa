"""SpeculativeConfig (vLLM's keys and errors), the --speculative-config flag, the ngram proposer."""

import argparse
import subprocess
import sys

import numpy as np
import pytest

from vllm.config.speculative import SpeculativeConfig, SpeculativeConfigError
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.metrics import SpecDecodingStats
from vllm.v1.spec_decode.ngram_proposer import NgramProposer


def test_ngram_defaults_and_one_bound():
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (4, 4, 3)
    c = SpeculativeConfig.from_cli(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3}'
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 3)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
         "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/m",
          "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ],
)
def test_bad_values_name_the_key(values, key):
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_dict(values)
    assert info.value.key == key
    assert key in str(info.value)


def test_draft_model_config_and_missing_path():
    c = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3})
    assert c.method == "draft_model" and c.num_lookahead_slots == 3
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).num_lookahead_slots == 0
    args = EngineArgs(speculative_config={"method": "draft_model", "model": "/no/such/draft",
                                          "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError, match="speculative_config: draft model '/no/such/draft"):
        args.validate()


def test_offline_bad_config_is_value_error_before_any_model_loads():
    from vllm import LLM

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(512\) must be below "
                                         r"max_model_len \(512\)"):
        LLM(max_model_len=512, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 512})


def test_cli_flag_parses_and_rejects():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    cfg = EngineArgs.from_cli_args(args)._configs_without_model()["speculative_config"]
    assert cfg.num_speculative_tokens == 4 and cfg.method == "ngram"


def test_serve_bad_flag_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}'],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "prompt_lookup_min must be an integer >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ngram_longest_suffix_earliest_match():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #                  0  1  2  3  4  5  6  7  8  9
    ctx = np.array([9, 1, 2, 3, 4, 5, 7, 2, 3, 1, 2, 3])
    # Suffix "1 2 3" (n = 3) occurs at 1 -> propose 4 5 7.
    assert p.propose(ctx) == [4, 5, 7]
    # Only "2 3" matches when the 3-gram differs; earliest occurrence (at 2) wins.
    ctx = np.array([2, 3, 8, 2, 3, 6, 0, 2, 3])
    assert p.propose(ctx) == [8, 2, 3]
    assert p.propose(ctx, max_tokens=1) == [8]
    # Nothing proposed below prompt_lookup_min, nor with no earlier occurrence.
    p2 = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    assert p2.propose(np.array([5, 1, 6, 7, 1])) == []
    assert p.propose(np.array([4])) == []
    # The proposal stops at the end of the context.
    assert p.propose(np.array([1, 2, 1])) == [2, 1]


def test_ngram_bad_args():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)


def test_spec_decoding_stats():
    s = SpecDecodingStats(num_spec_tokens=3)
    s.observe_draft(3, 2)
    before = s.copy()
    s.observe_draft(2, 0)
    s.observe_draft(3, 3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 5)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1]
    delta = s.minus(before)
    assert (delta.num_drafts, delta.num_accepted_tokens_per_pos) == (2, [1, 1, 1])
    assert delta.mean_acceptance_length == pytest.approx(1 + 3 / 2)
    with pytest.raises(ValueError):
        s.observe_draft(2, 3)


def test_ngram_equals_brute_force_on_random_histories():
    """The candidate-end search proposes what comparing every window for every n does."""

    def brute(ctx: list[int], k: int, lo: int, hi: int) -> list[int]:
        for n in range(min(hi, len(ctx) - 1), lo - 1, -1):
            for s in range(len(ctx) - n):  # windows of ctx[:-1]: s + n <= len - 1
                if ctx[s : s + n] == ctx[len(ctx) - n :]:
                    return ctx[s + n : s + n + k]
        return []

    rng = np.random.default_rng(1)
    for _ in range(300):
        ctx = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 30)))
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        cap = int(rng.integers(0, k + 2))
        expected = brute(ctx.tolist(), min(k, cap), lo, hi)
        assert NgramProposer(k, lo, hi).propose(ctx, cap) == expected, (ctx, k, lo, hi, cap)


def test_ngram_byte_search_skips_hits_across_token_boundaries():
    """Ids whose bytes line up across two tokens (a byte hit at an unaligned offset) are
    not a match; many such hits fall back to comparing windows, with the same result."""
    # int32 bytes of [256, 1] are 00 01 00 00 | 01 00 00 00: the suffix [1] (01 00 00 00)
    # occurs at byte 1 inside them, but as a token only at index 1.
    ctx = np.array([256, 1, 5, 1], dtype=np.int32)
    assert NgramProposer(2, 1, 1).propose(ctx) == [5, 1]
    ctx = np.array([256] * 20 + [7, 9, 1], dtype=np.int32)  # 20 unaligned hits, no token hit
    assert NgramProposer(2, 1, 1).propose(ctx) == []
    ctx = np.array([256] * 20 + [1, 3, 1], dtype=np.int32)  # the one token hit comes late
    assert NgramProposer(2, 1, 1).propose(ctx) == [3, 1]
