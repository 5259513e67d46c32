"""From a validated ServeConfig to a warmed-up runner and an engine over it.

The engine process (service/engine_client/worker.py) and the in-process Python API (service/llm.py)
both build their engine here, so that both run the same model, runner, graph cache and scheduler
for the same config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from cache_manager import CudaGraphMode, EngineHooks, GraphCache, GraphCacheConfig, parse_capture_sizes
from service.config import ConfigError, ServeConfig
from service.engine.adapters import AdapterError, AdapterRegistry, AdapterRootMissing, AdaptersOff, check_name
from service.engine.constraints import Constraints
from service.engine.engine import Engine
from service.engine.interfaces import EngineObserver, Publish, deliver
from service.engine.kv_sizing import size_kv_cache
from service.engine.ranks import Ranks, start_ranks
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.spec.adaptive import adaptive_k
from service.engine.spec.proposer import new_proposer
from service.model.kernels.compile_cache import CompileCache
from service.model.loader import LoadedModel, default_cache_dir, load_model, read_model_spec
from service.model.lora import LoraAdapter, LoraError, read_adapter
from service.model.parallel import TensorParallel, shard_spec
from service.model.spec import ModelLoadError
from service.telemetry import startup

log = structlog.get_logger("graphserve.builder")


@dataclass
class LoadedRunner:
    """A loaded model and its runner, warmed up: one real prefill and eager decode have run."""

    loaded: LoadedModel
    runner: ModelRunner
    max_seq_len: int  # the config's, capped by the model's context
    mode: CudaGraphMode  # NONE whenever the device is not CUDA
    adapters: AdapterRegistry | None = field(default=None)  # None: the server serves no adapters
    lora_root: Path | None = None  # adapters load only from under it (None: --lora-modules only)
    constraints: Constraints | None = None  # structured outputs (rank 0 only); the engine closes it
    draft: LoadedModel | None = None  # speculative method draft_model: the draft checkpoint

    @property
    def graphs(self) -> GraphCache:
        return self.runner.graphs

    def read_adapter(self, name: str, path: str | Path, remote: bool = False) -> LoraAdapter:
        """Reads and checks an adapter's files (any thread: no device work). LoraError if they do not fit;
        AdapterError when the name is taken, reserved or over --max-cpu-loras, checked before any file
        is read. `remote` (LoadAdapter) needs --lora-root; every path must resolve under it."""
        if self.adapters is None:
            raise AdaptersOff()
        check_name(name)
        if remote and self.lora_root is None:
            raise AdapterRootMissing()
        self.adapters.check_room(name)
        return read_adapter(name, path, self.loaded.spec, self.runner.lora.max_rank,
                            pin=self.loaded.device.type == "cuda", dtype=self.loaded.dtype, root=self.lora_root)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_runner(c: ServeConfig, hooks: EngineHooks | None = None,
                on_rank_death: Callable[[], None] | None = None) -> LoadedRunner:
    """Load the model, build its runner and graph cache, and run one eager step: a broken model
    fails here, not on the first request. With --tensor-parallel-size N > 1 this is rank 0: it
    starts the other N - 1 ranks (service/engine/rank_main.py), which load their shards beside it.
    hooks: the graph cache's line to the engine (new_engine attaches it); on_rank_death: called (on
    a watch thread) when another rank dies, by default the engine is woken to fail at once."""
    hooks = hooks if hooks is not None else EngineHooks()
    lr = _load_runner(c, hooks, on_rank_death or hooks.wake)
    prepare_graphs(lr, c.startup_graph_timeout)
    startup.mark("startup_graphs")
    return lr


def prepare_graphs(lr: LoadedRunner, timeout_s: float) -> None:
    """Before serving: the graph cache warms its kernels and captures its warm-start graphs within
    `timeout_s` (GraphCache.prepare); logged as `graph_startup`."""
    cache = lr.graphs
    report = cache.prepare(timeout_s)
    if cache.graphs_enabled:
        log.info("graph_startup", seconds=round(report.seconds, 3), kernels_warmed=report.kernels_warmed,
                 kernels_s=round(report.kernels_s, 3), captured=report.captured, left=report.left,
                 timed_out=report.timed_out, timeout_s=timeout_s)


def _load_runner(c: ServeConfig, hooks: EngineHooks, on_rank_death: Callable[[], None]) -> LoadedRunner:
    device = resolve_device(c.device)
    if c.tensor_parallel_size == 1:
        return build_runner(c, device, hooks=hooks)
    # A model that does not split into N shards fails here, before any rank starts.
    shard_spec(read_model_spec(c.model, c.model_cache_dir), TensorParallel(0, c.tensor_parallel_size))
    ranks, tp, device = start_ranks(c, device, on_rank_death)
    try:
        lr = build_runner(c, device, tp, ranks=ranks, hooks=hooks)
    except BaseException as exc:
        # A rank that died while loading (out of memory, ...) is the cause; a bad model fails every
        # rank the same way, and rank 0's own message says why.
        explain = isinstance(exc, Exception) and not isinstance(exc, ModelLoadError)
        error = ranks.explain(exc) if explain else exc
        ranks.close(send_stop=False, timeout=0.0)
        if error is exc:
            raise
        raise error from exc
    return lr


def load_draft(c: ServeConfig, target: LoadedModel) -> LoadedModel | None:
    """The draft checkpoint of --speculative-config's method draft_model, loaded as the target was;
    None for any other method. ConfigError naming the field `model` when it cannot draft for the target."""
    speculation = c.speculation
    if speculation is None or speculation.method != "draft_model":
        return None
    from service.engine.spec.draft_model import load_draft_model

    try:
        with startup.prefixed("draft_"):  # draft_weights_read ...: the target's phases stay where they ended
            draft = load_draft_model(speculation, target, c.model_cache_dir, batch_invariant=c.batch_invariant)
            startup.mark("tokenizer_check")
    except ValueError as exc:
        raise ConfigError(f"--speculative-config: {exc} ({c.model})") from None
    return draft


def build_runner(c: ServeConfig, device: torch.device, tp: TensorParallel | None = None,
                 follower: bool = False, ranks: Ranks | None = None, hooks: EngineHooks | None = None) -> LoadedRunner:
    """This rank's model (its shards with `tp`), runner and graph cache, warmed up. Rank 0 of N > 1
    (`ranks`) sends every step and its graph operations to the other ranks; a follower rank (rank
    > 0) keeps no stats and decides nothing: its graphs mirror rank 0's."""
    dtype = resolve_dtype(c.dtype, device)
    compile_cache = CompileCache.open(Path(c.compile_cache_dir or Path(c.model_cache_dir or default_cache_dir()) / "compile"))
    loaded = load_model(c.model, device, dtype, c.model_cache_dir, tp=tp, batch_invariant=c.batch_invariant,
                        quantization=c.quantization, kv_cache_dtype=c.kv_cache_dtype, compile_cache=compile_cache)
    if c.batch_invariant:
        log.info("batch_invariant_mode", device=str(device), dtype=str(dtype).removeprefix("torch."),
                 backend=loaded.model.invariant.backend)
    draft = load_draft(c, loaded)  # before the KV cache is sized: the draft's weights come first
    max_seq_len = min(c.max_seq_len, loaded.spec.max_position_embeddings)
    mode = CudaGraphMode.parse(c.cudagraph_mode) if device.type == "cuda" else CudaGraphMode.NONE
    # Tensor parallelism: every rank captures, replays and releases the same graphs in the same
    # order, as rank 0 decides; captures run on the engine thread (service/engine/roles.py), while
    # serving only when the engine has no work (cache_manager/manager.py).
    inline = tp is not None and tp.world_size > 1
    if inline and mode is not CudaGraphMode.NONE and not follower:
        log.info("tensor_parallel_graphs", world_size=tp.world_size, mode=mode.value, capture="inline, when idle",
                 budget="per rank")
    largest = max(c.max_running_seqs, c.max_num_batched_tokens)
    graph_config = GraphCacheConfig(
        mode=mode,
        capture_sizes=parse_capture_sizes(c.capture_sizes, largest) if c.capture_sizes else None,
        max_batch=c.max_running_seqs,
        max_tokens=c.max_num_batched_tokens,
        memory_budget=c.graph_memory_budget,
        stats_file=None if follower else c.stats_file,
        warm_start=c.warm_start and not follower,
        inline_capture=inline,
        pad_single_rows=not loaded.model.fp8,  # FP8's lone row: the GEMV, in company the GEMM (fp8.py)
    )
    kv_dtype = loaded.kv_cache_dtype
    kv = size_kv_cache(loaded.model.spec, kv_dtype, device, c.kv_cache_memory, c.block_size, c.max_running_seqs,
                       max_seq_len, c.graph_memory_budget, mode is not CudaGraphMode.NONE, tp)
    if not follower:
        log.info("kv_cache", blocks=kv.num_blocks - 1, block_size=kv.block_size, tokens=kv.tokens,
                 gib=round(kv.nbytes / 2**30, 3), dtype=str(kv_dtype).removeprefix("torch."),
                 checkpoint_scales=loaded.kv_scales is not None,
                 sequences_at_max_seq_len=(kv.num_blocks - 1) // -(-max_seq_len // kv.block_size),
                 prefix_caching=c.prefix_caching, sized_by=kv.source)
    constraints = None if follower else Constraints(loaded.tokenizer, loaded.spec.vocab_size, loaded.spec.eos_token_ids,
                                                   c.constraint_limits)
    runner = ModelRunner(loaded, c.max_running_seqs, max_seq_len, graph_config,
                         max_loras=c.lora_slots, max_lora_rank=c.max_lora_rank, lora_kernel=c.lora_kernel,
                         block_size=kv.block_size, num_blocks=kv.num_blocks,
                         masks=None if constraints is None else constraints.masks, ranks=ranks, hooks=hooks,
                         host_cache_bytes=c.kv_host_cache_bytes)
    if runner.host_kv is not None and not follower:
        log.info("kv_host_cache", blocks=runner.host_kv.num_slots, gib=round(runner.host_kv.nbytes() / 2**30, 3),
                 pinned=device.type == "cuda")
    startup.mark("kv_pool")
    runner.warmup()  # a prompt chunk and a decode, eagerly: every step kind has a path before SERVING
    startup.mark("warmup")
    if follower:
        runner.follow()
    adapters = AdapterRegistry(c.lora_slots, runner.lora, c.max_cpu_loras) if runner.lora is not None else None
    lr = LoadedRunner(loaded, runner, max_seq_len, mode, adapters, c.lora_root, constraints, draft)
    for name, path in c.lora_module_paths():  # a bad adapter fails the start, naming its file
        try:
            adapters.register(lr.read_adapter(name, path))
        except (LoraError, AdapterError) as exc:
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from None
    return lr


def new_engine(c: ServeConfig, lr: LoadedRunner, publish: Publish = deliver,
               observer: EngineObserver | None = None) -> Engine:
    """An engine (not started) over the runner; between steps it commits the graphs the capture
    thread finished (with inline capture: captures them, on every rank), warm-starts graphs and
    saves stats (GraphCache.between_steps). The graph cache's hooks attach to it: a finished capture
    wakes it, and with tensor parallelism captures wait until it has no work."""
    graphs = lr.graphs
    ranks = lr.runner.ranks

    def between_steps() -> None:
        if ranks is not None:
            ranks.check()  # a dead rank fails the engine even while it is idle
        graphs.between_steps()

    speculation = c.speculation
    proposer = None
    if speculation is not None:
        try:
            proposer = new_proposer(speculation, lr.loaded.model, lr.loaded.device, draft=lr.draft)
        except ValueError as exc:  # a field the model refuses (draft_layers' layer count)
            raise ConfigError(f"--speculative-config: {exc} ({c.model})") from None
    scheduler = Scheduler(c.max_running_seqs, c.max_num_batched_tokens, adapters=lr.adapters,
                          blocks=lr.runner.new_block_pool(c.prefix_caching), proposer=proposer,
                          num_speculative_tokens=speculation.num_speculative_tokens if speculation else 0,
                          adaptive=adaptive_k(speculation) if speculation else None)
    if speculation is not None:
        if observer is not None:  # an empty report: the metrics show speculation's series from the start
            observer.on_speculation(0, 0, [])
        log.info("speculative_decoding", method=speculation.method, k=speculation.num_speculative_tokens,
                 verify_token_budget=speculation.verify_token_budget,
                 disable_by_batch_size=speculation.disable_by_batch_size,
                 prompt_lookup_min=speculation.prompt_lookup_min, prompt_lookup_max=speculation.prompt_lookup_max,
                 num_draft_layers=speculation.num_draft_layers, draft_model=speculation.model)
    engine = Engine(lr.runner, scheduler, lr.loaded.tokenizer,
                    frozenset(lr.loaded.spec.eos_token_ids), publish=publish, observer=observer,
                    between_steps=between_steps, overlap=c.overlap_steps, constraints=lr.constraints,
                    slow_step_s=c.slow_step_threshold_ms / 1000)
    graphs.hooks.attach(engine)
    return engine


def close_engine(engine: Engine, graphs: GraphCache, timeout: float = 10.0) -> bool:
    """Stop the engine; free the graphs once its thread is gone (a step that would not stop still
    uses the device, so then only the stats are saved). Returns whether the stats were saved."""
    engine.stop(timeout)
    saved = graphs.close() if not engine.thread_alive else graphs.save()
    ranks = getattr(engine.runner, "ranks", None)
    if ranks is not None:  # a stop message only when no step is left half-run on the other ranks
        ranks.close(send_stop=not engine.thread_alive and engine.error is None)
    return saved
