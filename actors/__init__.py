"""mlx-nursery's engine: a Trio actor graph around mlx-lm's models and batch caches.

See ``engine.open_engine`` for the embedding API.
"""

from .engine import Engine, open_engine
from .errors import (
    ContextOverflow,
    EngineClosed,
    EngineError,
    GenerationFailed,
    InvalidRequest,
    Overloaded,
)
from .models.load import ModelInfo
from .request import (
    CacheReason,
    CacheReport,
    CacheTier,
    Event,
    FinishReason,
    Lane,
    Request,
    Result,
    SamplingParams,
    TopLogprob,
    Usage,
)
from .row import RowView, SessionView
from .settings import EngineSettings
from .stats import HistogramSnapshot, StatsSnapshot
from .stream import RequestStream
from .tools import ToolCall

__all__ = [
    "CacheReason",
    "CacheReport",
    "CacheTier",
    "ContextOverflow",
    "Engine",
    "EngineClosed",
    "EngineError",
    "EngineSettings",
    "Event",
    "FinishReason",
    "GenerationFailed",
    "HistogramSnapshot",
    "InvalidRequest",
    "Lane",
    "ModelInfo",
    "Overloaded",
    "Request",
    "RequestStream",
    "Result",
    "RowView",
    "SamplingParams",
    "SessionView",
    "StatsSnapshot",
    "ToolCall",
    "TopLogprob",
    "Usage",
    "open_engine",
]
