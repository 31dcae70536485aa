"""`CompilationConfig`: eager mode and the CUDA graph batch sizes for decode."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config.frozen import FrozenConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

_ALLOWED_KEYS = ("enforce_eager", "cudagraph_capture_sizes")


def default_cudagraph_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's size ladder, cut at max_num_seqs, which is always included.

    1, 2, 4, then every 8 up to 248, then every 16 from 256. Including
    max_num_seqs itself means every decode batch pads up to a captured size.
    """
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs + 1, 16)]
    sizes = [s for s in ladder if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class CompilationConfig(FrozenConfig):
    """Whether and at which decode batch sizes CUDA graphs are captured.

    Attributes:
        enforce_eager: never use CUDA graphs.
        cudagraph_capture_sizes: decode batch sizes (sequences) to capture,
            ascending; None = `default_cudagraph_capture_sizes(max_num_seqs)`.
            Sizes above max_num_seqs are dropped with a warning. Resolved even
            where graphs are off, as the decode sizes warmup runs.
        use_cudagraph: resolved: graphs are captured (not enforce_eager and the
            platform supports them). Not an argument.

    Raises:
        ValueError: sizes that are not ints >= 1, or an unknown key in `from_dict`.
    """

    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    use_cudagraph: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None:
            bad = [s for s in self.cudagraph_capture_sizes
                   if not isinstance(s, int) or isinstance(s, bool) or s < 1]
            if bad or not self.cudagraph_capture_sizes:
                raise ValueError(
                    "cudagraph_capture_sizes must be a non-empty list of ints >= 1, "
                    f"got {self.cudagraph_capture_sizes!r}"
                )

    @classmethod
    def from_dict(cls, values: dict) -> CompilationConfig:
        unknown = sorted(set(values) - set(_ALLOWED_KEYS))
        if unknown:
            raise ValueError(
                f"compilation_config has unknown keys {unknown}; supported: {list(_ALLOWED_KEYS)}"
            )
        return cls(**values)

    def resolve(self, max_num_seqs: int, graphs_supported: bool) -> None:
        """Fix the capture sizes for `max_num_seqs` and whether graphs are used."""
        if self.cudagraph_capture_sizes is None:
            sizes = default_cudagraph_capture_sizes(max_num_seqs)
        else:
            sizes = sorted(set(self.cudagraph_capture_sizes))
            dropped = [s for s in sizes if s > max_num_seqs]
            if dropped:
                logger.warning(
                    "cudagraph_capture_sizes %s exceed max_num_seqs %d and are dropped",
                    dropped, max_num_seqs,
                )
                sizes = [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]
        self.cudagraph_capture_sizes = sizes
        self.use_cudagraph = graphs_supported and not self.enforce_eager

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0
