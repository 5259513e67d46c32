"""Counters per requested (unpadded) size and per bucket, keyed by descriptor, their merge and JSON schema."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from cache_manager.sizes import BatchDescriptor

EAGER_REASONS = ("above_max", "mode_none", "budget", "failed", "capturing")
_SUMMED = ("requests", "replays", "padded_rows", "captures", "evictions", "failures")


@dataclass
class Counters:
    """Counts (summed across runs) plus the latest measurements (newest wins across runs).

    Requested sizes use requests/replays/eager; buckets use all fields.
    """

    requests: int = 0
    replays: int = 0
    padded_rows: int = 0
    captures: int = 0
    evictions: int = 0
    failures: int = 0
    eager: dict[str, int] = field(default_factory=dict)  # reason -> count
    capture_ms: float = 0.0  # latest capture
    bytes: int = 0  # latest measured graph memory
    last_use: float | None = None  # wall time

    def add_eager(self, reason: str) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1

    @property
    def eager_total(self) -> int:
        return sum(self.eager.values())

    def merged(self, newer: Counters) -> Counters:
        out = Counters(**{name: getattr(self, name) + getattr(newer, name) for name in _SUMMED})
        out.eager = dict(self.eager)
        for reason, count in newer.eager.items():
            out.eager[reason] = out.eager.get(reason, 0) + count
        out.capture_ms = newer.capture_ms or self.capture_ms
        out.bytes = newer.bytes or self.bytes
        out.last_use = newer.last_use if newer.last_use is not None else self.last_use
        return out

    def to_json(self) -> dict:
        return {
            f.name: (dict(self.eager) if f.name == "eager" else getattr(self, f.name)) for f in fields(self)
        }

    @classmethod
    def from_json(cls, data: object) -> Counters:
        if not isinstance(data, dict):
            raise ValueError(f"counters must be an object, got {type(data).__name__}")
        out = cls()
        for name in _SUMMED:
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"counter {name!r} must be a non-negative integer, got {value!r}")
            setattr(out, name, value)
        eager = data.get("eager", {})
        if not isinstance(eager, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in eager.items()
        ):
            raise ValueError(f"'eager' must map reasons to non-negative integers, got {eager!r}")
        out.eager = dict(eager)
        for name, kinds in (("capture_ms", (int, float)), ("bytes", (int,))):
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
                raise ValueError(f"{name!r} must be a non-negative number, got {value!r}")
            setattr(out, name, value)
        last_use = data.get("last_use")
        if last_use is not None and (isinstance(last_use, bool) or not isinstance(last_use, (int, float))):
            raise ValueError(f"'last_use' must be a number or null, got {last_use!r}")
        out.last_use = last_use
        return out


@dataclass
class StatsTables:
    """Counters keyed by requested size and by bucket (padded size), each with the rest of its
    descriptor (graph kind, LoRA): a requested FULL size is a batch of rows, a requested PIECEWISE
    size a step's token count."""

    requested: dict[BatchDescriptor, Counters] = field(default_factory=dict)
    buckets: dict[BatchDescriptor, Counters] = field(default_factory=dict)

    def req(self, key: BatchDescriptor) -> Counters:
        return self.requested.setdefault(key, Counters())

    def bucket(self, key: BatchDescriptor) -> Counters:
        return self.buckets.setdefault(key, Counters())

    def merged(self, newer: StatsTables) -> StatsTables:
        def merge(a: dict[BatchDescriptor, Counters], b: dict[BatchDescriptor, Counters]) -> dict:
            return {k: a.get(k, Counters()).merged(b.get(k, Counters())) for k in sorted(a.keys() | b.keys())}

        return StatsTables(merge(self.requested, newer.requested), merge(self.buckets, newer.buckets))

    def as_lora(self) -> StatsTables:
        """The same counters keyed by the LoRA descriptors (the separate LoRA stats file of earlier versions)."""
        def lora(table: dict[BatchDescriptor, Counters]) -> dict[BatchDescriptor, Counters]:
            return {dataclasses.replace(k, lora=True): c for k, c in table.items()}

        return StatsTables(lora(self.requested), lora(self.buckets))

    @property
    def has_lora(self) -> bool:
        return any(k.lora for k in (*self.requested, *self.buckets))

    def to_json(self) -> dict:
        return {
            "requested": {str(k): v.to_json() for k, v in sorted(self.requested.items())},
            "buckets": {str(k): v.to_json() for k, v in sorted(self.buckets.items())},
        }

    @classmethod
    def from_json(cls, data: object) -> StatsTables:
        """Keys "full:8" / "piecewise:128" / "full+lora:8"; a bare "8" (stats format 1) is FULL."""
        if not isinstance(data, dict):
            raise ValueError("stats tables must be an object")

        def table(name: str) -> dict[BatchDescriptor, Counters]:
            raw = data.get(name)
            if not isinstance(raw, dict):
                raise ValueError(f"{name!r} must be an object keyed by graph kind and size")
            out: dict[BatchDescriptor, Counters] = {}
            for key, value in raw.items():
                try:
                    descriptor = BatchDescriptor.parse(key) if isinstance(key, str) else None
                except ValueError:
                    descriptor = None
                if descriptor is None:
                    raise ValueError(f"{name!r} key {key!r} is not a positive size (optionally kind:size)")
                out[descriptor] = Counters.from_json(value)
            return out

        return cls(table("requested"), table("buckets"))
