"""Building the in-process engine from the settings.

Apart from gateway/app.py so that `tiergate worker`, which runs an engine but no HTTP
side and no database, does not import the app (and with it alembic, whose set-up lines
would open every worker's log).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.settings import Settings
from scheduler.dispatcher import EngineLike

if TYPE_CHECKING:
    from engine.config import EngineConfig


def engine_config(settings: Settings) -> EngineConfig:
    """The engine configuration the settings describe."""
    from engine.config import EngineConfig

    extra: dict[str, int] = {}
    if settings.max_num_seqs is not None:
        extra["max_num_seqs"] = settings.max_num_seqs
        # A step holds a decode token of every running sequence: past the default token
        # budget, the budget grows with them (no setting names it, and the engine refused
        # the combination in terms of it).
        default_budget = EngineConfig.max_num_batched_tokens
        extra["max_num_batched_tokens"] = max(default_budget, settings.max_num_seqs)
    return EngineConfig(
        model=settings.model,
        device=settings.device,
        kv_cache_bytes=settings.kv_cache_bytes,
        max_model_len=settings.max_model_len,
        **extra,
    )


def build_engine(settings: Settings) -> EngineLike:
    """The in-process engine the settings describe (loads the model)."""
    from engine.async_engine import AsyncEngine

    return AsyncEngine(engine_config(settings))
