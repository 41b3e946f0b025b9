"""mlx-nursery's engine: a Trio actor graph around mlx-lm's models and batch caches.

See ``engine.open_engine`` for the embedding API.
"""

from .engine import Engine, ModelInfo, RequestStream, open_engine
from .errors import ContextOverflow, EngineClosed, EngineError, GenerationFailed, InvalidRequest
from .request import Event, Lane, Result, SamplingParams, TopLogprob, Usage
from .stats import HistogramSnapshot, StatsSnapshot

__all__ = [
    "ContextOverflow",
    "Engine",
    "EngineClosed",
    "EngineError",
    "Event",
    "GenerationFailed",
    "HistogramSnapshot",
    "InvalidRequest",
    "Lane",
    "ModelInfo",
    "RequestStream",
    "Result",
    "SamplingParams",
    "StatsSnapshot",
    "TopLogprob",
    "Usage",
    "open_engine",
]
