"""`EngineClient`: everything the ways in (the servicers, `Streams`, the Python API's `LLM`) use of
an engine, whether it runs in this process (InProcessEngine) or in an engine process of its own
(EngineProcess); and `EngineFacts`, what an engine reports once its model is loaded.

Sinks are called where the implementation delivers events: on the engine thread in this process,
on the event loop that reads the engine process's pipe. `request` blocks until its reply, so it
never runs on that event loop; `call` runs a function of requests off it, one at a time.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from service.config import ServeConfig
    from service.engine.builder import LoadedRunner
    from service.engine.interfaces import Sink
    from service.engine.request import GenerationRequest
    from service.engine_client.calls import EngineCall

T = TypeVar("T")


@dataclass(frozen=True)
class EngineFacts:
    """What serving needs to know of a loaded engine: the model's description and the graph cache's shape."""

    model_path: str
    spec: Any  # ModelSpec
    max_seq_len: int
    device: str
    dtype: str
    graph_config: Any  # GraphCacheConfig
    graph_mode: str
    graphs_device: str
    has_graph_backend: bool
    adapters: tuple[str, ...] = ()  # loaded at start (--lora-modules)
    max_loras: int = 0  # adapter slots; 0: adapters are off, and no LoRA graphs
    max_lora_rank: int = 0
    kv_cache_dtype: str = ""  # what the KV cache stores, e.g. bfloat16 or float8_e4m3fn ("": dtype)
    # The engine process's start-up phases: (name, time.monotonic() at its end), service.telemetry.startup
    startup: tuple[tuple[str, float], ...] = ()

    @property
    def architecture(self) -> str:
        """The served model's, e.g. "Qwen3MoeForCausalLM"."""
        return getattr(self.spec, "architecture", "")


def facts_of(c: ServeConfig, lr: LoadedRunner) -> EngineFacts:
    loaded, graphs = lr.loaded, lr.graphs
    return EngineFacts(
        model_path=str(loaded.path), spec=loaded.spec, max_seq_len=lr.max_seq_len, device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."), graph_config=graphs.config, graph_mode=lr.mode.value,
        graphs_device=str(graphs.device), has_graph_backend=graphs.backend is not None,
        adapters=tuple(lr.adapters.names) if lr.adapters is not None else (), max_loras=c.lora_slots,
        max_lora_rank=c.max_lora_rank if lr.adapters is not None else 0,
        kv_cache_dtype=str(loaded.kv_cache_dtype).removeprefix("torch."),
    )


class EngineClient(Protocol):
    """An engine, from the side of its callers."""

    facts: EngineFacts
    adapter_names: set[str]  # the adapters loaded now: what Generate accepts without asking the engine
    error: BaseException | None  # why the engine failed (None while it has not)
    last_progress: float  # time.monotonic() of its last step that did something, or of its last idle moment

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> str:
        """Queue a request; its events go to `sink`. Returns the key that `abort` and `pause` take.
        Raises EngineStopped when the engine no longer accepts work."""
        ...

    def abort(self, key: str) -> None: ...

    def pause(self, key: str, paused: bool) -> None:
        """Back-pressure: stop (or resume) decoding a request whose client has not read its tokens."""
        ...

    # ---- state --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Running and accepting work."""
        ...

    @property
    def responsive(self) -> bool:
        """Answering (a hung engine process reads nothing sent to it)."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_waiting(self) -> int:
        """Requests that wait for a slot (those that will take a free one do not)."""
        ...

    def waiting_after(self, samples: int) -> int:
        """Requests that would wait if `samples` more were submitted now."""
        ...

    @property
    def waiting_prompt_tokens(self) -> int: ...

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(used, total) KV blocks."""
        ...

    def has_pending_work(self) -> bool:
        """Work the engine should be making progress on (paused streams are not)."""
        ...

    # ---- typed calls --------------------------------------------------------------------------

    def request(self, call: EngineCall[T], timeout: float | None = None) -> T:
        """The engine's reply to `call` (within `timeout`, by default the call's); blocking."""
        ...

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn (which makes requests) on a thread of this client, one at a time: the admin operations."""
        ...

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine: running requests end with an EngineError, the graph cache saves its stats
        and frees its graphs. Returns whether it stopped cleanly with its stats saved."""
        ...
