"""Building the in-process engine from the settings.

Apart from gateway/app.py so that `tiergate worker`, which runs an engine but no HTTP
side and no database, does not import the app (and with it alembic, whose set-up lines
would open every worker's log).
"""

from __future__ import annotations

from gateway.settings import Settings
from scheduler.dispatcher import EngineLike


def build_engine(settings: Settings) -> EngineLike:
    """The in-process engine the settings describe (loads the model)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    extra = {} if settings.max_num_seqs is None else {"max_num_seqs": settings.max_num_seqs}
    config = EngineConfig(
        model=settings.model,
        device=settings.device,
        kv_cache_bytes=settings.kv_cache_bytes,
        max_model_len=settings.max_model_len,
        **extra,
    )
    return AsyncEngine(config)
