"""Time one batch through an offline engine step by step: TTFT and steady decode apart.

    add every request ──> step 1 ... step k ──> step k+1 ... step n
                         └── prefill(s) ──┘ every request has its first token
    ttft_s = time until every request has sampled its first token
    decode_s = the rest; decode steps = n - k

A whole-run tokens/s mixes the two: the prefill (and, before issue 10, any
Triton compilation it triggered) weighs on a batch-1 figure as much as dozens
of decode steps. `random_token_prompts` gives prompts that share no block with
anything the engine has seen (with prefix caching a repeated prompt would be a
cache hit, and the timed prefill would shrink to its last block).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass


@dataclass
class BatchTiming:
    """One batch's timing (seconds) and work (tokens)."""

    batch: int
    ttft_s: float  # until every request has its first token
    decode_s: float  # from then until the last request finished
    total_s: float
    prefill_steps: int
    decode_steps: int
    decode_step_ms_median: float  # of the decode steps (0 with none)
    output_tokens: int
    decode_tokens: int  # output tokens sampled in decode steps
    prefix_cache_hit_tokens: int  # in this batch (0 means the timed work is the full prompt)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s,
                "output_tokens_per_s": self.output_tokens / self.total_s}


def random_token_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    """`batch` prompts of `input_len` random token ids in [3, vocab_size) (ids 0-2 are special)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(input_len)]}
            for _ in range(batch)]


def time_batch(llm, prompts: list, params) -> BatchTiming:
    """Run `prompts` with `params` on `llm` (an offline `LLM`), one engine step at a time.

    Every step returns only after sampled tokens reached the host, so the wall
    time between steps is the device time plus the host work the device waits
    for. With async scheduling a step returns the previous step's tokens
    (after launching the next), so the first call returns nothing and the
    gaps measure the overlapped loop. Raises what
    `LLMEngine.add_request` raises (nothing runs then).
    """
    engine = llm.llm_engine
    hits_before = engine.get_scheduler_stats().prefix_cache_hits
    ids = [f"timed-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    first_all = None
    step_ends = []
    tokens: dict[str, int] = {}
    prefill_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        step_ends.append(now)
        for out in outputs:
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            started.add(out.request_id)
        if first_all is None:
            prefill_steps += 1
            if len(started) == len(ids):
                first_all = now
    end = step_ends[-1] if step_ends else t0
    first_all = first_all or end
    decode_ends = [t for t in step_ends if t > first_all]
    gaps = [b - a for a, b in zip([first_all, *decode_ends], decode_ends, strict=False)]
    output_tokens = sum(tokens.values())
    return BatchTiming(
        batch=len(prompts),
        ttft_s=first_all - t0,
        decode_s=end - first_all,
        total_s=end - t0,
        prefill_steps=prefill_steps,
        decode_steps=len(decode_ends),
        decode_step_ms_median=1e3 * statistics.median(gaps) if gaps else 0.0,
        output_tokens=output_tokens,
        decode_tokens=output_tokens - len(prompts),
        prefix_cache_hit_tokens=engine.get_scheduler_stats().prefix_cache_hits - hits_before,
    )
