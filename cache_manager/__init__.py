"""The graph cache: allowed sizes and padding, capture/replay, memory budget and eviction, stats.

Imports torch and structlog; never grpc and never `service`.
"""

from cache_manager.backend import CapturedGraph, CudaGraphBackend, GraphBackend
from cache_manager.budget import parse_memory_budget, resolve_budget
from cache_manager.config import GraphCacheConfig
from cache_manager.dispatch import StepPlan
from cache_manager.hooks import EngineHooks
from cache_manager.manager import GraphCache
from cache_manager.ops import GraphsUnavailableError, OpOutcome, OpResult
from cache_manager.ordering import BesideServing, RankOrder
from cache_manager.sizes import (
    BatchDescriptor,
    CudaGraphMode,
    GraphFamily,
    PaddingTable,
    default_capture_sizes,
    parse_capture_sizes,
)
from cache_manager.snapshot import BucketCounters, BucketEntry, BucketState, CacheSnapshot, RequestedSize
from cache_manager.step import DecodeStep
from cache_manager.store import Fingerprint, StatsStore

__all__ = [
    "BatchDescriptor",
    "BesideServing",
    "BucketCounters",
    "BucketEntry",
    "BucketState",
    "CacheSnapshot",
    "CapturedGraph",
    "CudaGraphBackend",
    "CudaGraphMode",
    "DecodeStep",
    "EngineHooks",
    "Fingerprint",
    "GraphBackend",
    "GraphCache",
    "GraphCacheConfig",
    "GraphFamily",
    "GraphsUnavailableError",
    "OpOutcome",
    "OpResult",
    "PaddingTable",
    "RankOrder",
    "RequestedSize",
    "StatsStore",
    "StepPlan",
    "default_capture_sizes",
    "parse_capture_sizes",
    "parse_memory_budget",
    "resolve_budget",
]
