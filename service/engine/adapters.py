"""The adapter registry: adapter names to device slots, for the engine thread. Pure logic: no torch.

An adapter is *registered* (its weights read from disk, held in host memory) and, while sequences
use it, *resident* in one of `max_loras` device slots (1..max_loras; slot 0 is the base model).
A sequence holds its adapter from submit to finish (`hold` / `unhold`: unload is refused meanwhile)
and holds its slot from admission to release (`admit` / `release`). When more adapters are
registered than there are slots, admission reuses the least recently used slot that no running
sequence holds; if every slot is held, the sequence waits for one. At most `max_adapters` are
registered (their weights take host memory). Not thread-safe: only the engine thread changes it
(admin operations arrive through Engine.call); `count` and `in` are single reads, safe from the
thread that reads adapter files, for a check before it reads.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol


class AdapterError(ValueError):
    """An adapter operation the caller must change (the message says how)."""


class AdapterNotFound(AdapterError):
    pass


class AdapterExists(AdapterError):
    pass


class AdapterInUse(AdapterError):
    pass


class InvalidAdapterName(AdapterError):
    pass


class AdapterLimit(AdapterError):
    """As many adapters are registered as --max-cpu-loras allows."""


class AdapterRootMissing(AdapterError):
    """LoadAdapter on a server started without --lora-root."""

    def __init__(self, message: str = "this server loads adapters only at start (--lora-modules); start it with "
                                      "--lora-root DIR to load adapters from under DIR while serving") -> None:
        super().__init__(message)  # one argument: it pickles back the same across the engine pipe


# Names the per-adapter metric labels use for the base model and for adapters past the label cap
# (service.telemetry.engine_metrics): an adapter may not take them.
RESERVED_NAMES = frozenset({"base", "other"})


def check_name(name: str) -> None:
    """AdapterError unless `name` can name an adapter."""
    if not name or not name.isprintable() or len(name) > 128:
        raise InvalidAdapterName(f"adapter name {name[:140]!r} must be 1 to 128 printable characters")
    if name.lower() in RESERVED_NAMES:
        raise InvalidAdapterName(f"adapter name {name!r} is reserved (the metric labels use 'base' for the base model "
                           "and 'other' for adapters past the label cap); pick another name")


class AdaptersOff(AdapterError):
    """The server was started without adapter slots."""

    def __init__(self, what: str = "this server") -> None:
        super().__init__(f"{what} serves no adapters; start it with --max-loras N (or --lora-modules)")


class SlotWriter(Protocol):
    """The device side (service.model.lora.LoraSlots)."""

    def load(self, slot: int, adapter: Any) -> None: ...
    def clear(self, slot: int) -> None: ...


@dataclass(frozen=True)
class AdapterInfo:
    """What ListAdapters shows of one adapter."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    slot: int  # 0: not resident on the device
    active_streams: int  # submitted and not finished (waiting or running)


class AdapterRegistry:
    def __init__(self, max_loras: int, writer: SlotWriter, max_adapters: int = 32) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras, self.max_adapters = max_loras, max_adapters
        self.writer = writer
        self._adapters: dict[str, Any] = {}  # name -> LoraAdapter (host weights)
        self._holds: dict[str, int] = {}  # name -> streams submitted and not finished
        self._slot_of: dict[str, int] = {}  # resident adapters
        self._running: dict[int, int] = {}  # slot -> running sequences on it
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))  # oldest first
        self._keys: dict[str, str] = {}  # name -> its prefix-cache key (one per registration)
        self._registrations = itertools.count()

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    @property
    def count(self) -> int:
        return len(self._adapters)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def check_room(self, name: str) -> None:
        """AdapterExists or AdapterLimit when `name` could not be registered now."""
        existing = self._adapters.get(name)
        if existing is not None:
            raise AdapterExists(f"adapter {name!r} is already loaded (from {existing.path}); unload it first to "
                                "replace it")
        if len(self._adapters) >= self.max_adapters:
            raise AdapterLimit(f"{len(self._adapters)} adapters are loaded, as many as --max-cpu-loras "
                               f"{self.max_adapters} allows; unload one first")

    def register(self, adapter: Any) -> None:
        """Adds a read adapter (adapter.name, .path, .rank, .targets); not resident until used."""
        self.check_room(adapter.name)
        self._adapters[adapter.name] = adapter
        self._holds.setdefault(adapter.name, 0)
        self._keys[adapter.name] = f"{adapter.name}#{next(self._registrations)}"

    def cache_key(self, name: str) -> str:
        """What the prefix cache keys `name`'s blocks by: one per registration, so KV computed under an
        adapter since unloaded never serves a new one loaded under the same name."""
        return self._keys[name]

    def unregister(self, name: str) -> None:
        """Removes an adapter no stream uses; AdapterInUse while any does (waiting or running)."""
        if name not in self._adapters:
            raise AdapterNotFound(f"adapter {name!r} is not loaded; loaded: {self.names or 'none'}")
        if self._holds.get(name, 0):
            raise AdapterInUse(f"adapter {name!r} is used by {self._holds[name]} stream(s); unload it after they end "
                               "(the server does not drain them for you)")
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            assert not self._running.get(slot), f"slot {slot} of {name} is still running"
            self.writer.clear(slot)
            self._lru.move_to_end(slot, last=False)  # a free slot: reused first
        del self._adapters[name]
        self._holds.pop(name, None)
        self._keys.pop(name, None)

    # ---- per sequence ------------------------------------------------------------------------

    def hold(self, name: str) -> None:
        """A stream using `name` was submitted: unload is refused until `unhold`."""
        if name not in self._adapters:
            raise AdapterNotFound(f"adapter {name!r} is not loaded; loaded: {self.names or 'none'}")
        self._holds[name] += 1

    def unhold(self, name: str) -> None:
        assert self._holds.get(name, 0) > 0, name
        self._holds[name] -= 1

    def admit(self, name: str) -> int | None:
        """The slot for a sequence of `name` being admitted (loading the weights into a slot when not
        resident); None when every slot is held by running sequences of other adapters."""
        slot = self._slot_of.get(name)
        if slot is None:
            slot = next((s for s in self._lru if not self._running.get(s)), None)
            if slot is None:
                return None
            evicted = next((n for n, s in self._slot_of.items() if s == slot), None)
            if evicted is not None:
                del self._slot_of[evicted]
            self.writer.load(slot, self._adapters[name])
            self._slot_of[name] = slot
        self._running[slot] = self._running.get(slot, 0) + 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        """A running sequence on `slot` finished or was aborted."""
        assert self._running.get(slot, 0) > 0, slot
        self._running[slot] -= 1

    def request_adapters(self) -> tuple[list[str], list[str]]:
        """The adapters of running sequences and those of streams still waiting for admission (sorted).
        Any thread may call it: it reads copies of the engine thread's dicts (each copy is one call
        under the GIL)."""
        holds, slot_of, running = dict(self._holds), dict(self._slot_of), dict(self._running)
        running_of = {name: running.get(slot, 0) for name, slot in slot_of.items()}
        return (sorted(n for n, count in running_of.items() if count),
                sorted(n for n, count in holds.items() if count > running_of.get(n, 0)))

    def list(self) -> list[AdapterInfo]:
        return [AdapterInfo(n, a.path, a.rank, tuple(a.targets), self._slot_of.get(n, 0), self._holds.get(n, 0))
                for n, a in sorted(self._adapters.items())]
