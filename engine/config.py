"""Engine settings: one frozen object built at the edge and passed down.

Derived values (the KV block count, the resolved device and dtype) are returned by the
components that compute them, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

TINY_RANDOM = "tiny-random"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and how much it may batch.

    model: a Hugging Face checkpoint directory or `tiny-random`.
    kv_cache_bytes: KV cache budget; None sizes it from free memory (CUDA) or a fixed
    share of the model's context on CPU.
    max_prefill_chunk_tokens: the longest prefill piece one step runs (chunked prefill);
    None means no cap beyond the step's token budget. enable_chunked_prefill=False runs
    every prompt in one step (then max_model_len is capped at max_num_batched_tokens).
    """

    model: str = TINY_RANDOM
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_prefill_chunk_tokens: int | None = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise InvalidRequestError(f"device must be one of {DEVICES}", param="device")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {DTYPES}", param="dtype")
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        if self.max_prefill_chunk_tokens is not None:
            positive["max_prefill_chunk_tokens"] = self.max_prefill_chunk_tokens
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        if self.kv_cache_bytes is not None:
            positive["kv_cache_bytes"] = self.kv_cache_bytes
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer", param=name)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization"
            )
