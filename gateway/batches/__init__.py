"""The OpenAI Batch API: files, batches, and the driver that runs them durably."""

from gateway.batches.driver import BatchDriver, DriverConfig
from gateway.batches.lines import LineRunner
from gateway.batches.routes import BatchDeps, BatchRoutes
from gateway.batches.store import BatchStore

__all__ = ["BatchDeps", "BatchDriver", "BatchRoutes", "BatchStore", "DriverConfig", "LineRunner"]
