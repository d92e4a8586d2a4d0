"""In-process inference engine: paged KV cache, continuous batching, preemption.

`from engine import LLM, SamplingParams` is the offline API. Heavy (torch) modules are
imported lazily so the policy parts (request, block manager, step scheduler) stay
importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.request import FinishReason, Priority, SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput

__all__ = ["LLM", "FinishReason", "Priority", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
