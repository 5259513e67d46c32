"""The engine thread: schedule, launch, postprocess, publish. With overlap (the default) it launches
step t+1 on the device before it reads step t's tokens, so the host's postprocessing of step t
runs while the device computes step t+1; without it each step is read right after its launch.

Other threads talk to it only through `submit`, `abort` and `call`, which queue work that the
engine thread applies between steps. Events reach clients through `publish`, called once per step
with every (sink, event) pair of that step, so the gRPC side can hand them to its event loop in one
wake-up instead of one per token. The step's KV events (kv_events.py), once `publish_kv_events`
named their sink, travel in the same call as one more pair.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from service.engine.adapters import AdapterNotFound
from service.engine.constraint_prepare import ConstraintsBusy
from service.engine.detokenizer import token_bytes
from service.engine.interfaces import EngineObserver, EngineStopped, Publish, Runner, Sink, deliver
from service.engine.output import RequestOutput
from service.engine.request import (
    AdapterGone,
    ConstraintFailed,
    EngineBusy,
    EngineError,
    Finish,
    FinishReason,
    GenerationRequest,
    RequestEvent,
)
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus
from service.engine.slow_steps import SlowSteps
from service.engine.spec.stats import SpecDecodeStats

log = structlog.get_logger("graphserve.engine")

@dataclass
class _InFlight:
    seqs: tuple[Sequence, ...]  # the sequences that sample, in the order of the launch's tokens
    launched: Any  # the runner's handle
    # Speculative decoding: the draft of each verify row (its 1 + k tokens follow each other).
    drafts: dict[Sequence, tuple[int, ...]] | None = None
    # Decodes whose grammar mask was not ready (mask_fill.py): their tokens are void.
    sat_out: frozenset[Sequence] = frozenset()


class Engine:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        publish: Publish = deliver,
        observer: EngineObserver | None = None,
        between_steps: Callable[[], None] | None = None,
        overlap: bool = True,
        constraints: Any = None,
        slow_step_s: float = 0.1,
    ) -> None:
        """constraints: constraints.Constraints, for requests with a constraint (None: none accepted);
        the engine closes it when it stops. slow_step_s: a step whose host work takes longer is
        logged (slow_steps.py; --slow-step-threshold-ms, 0: never)."""
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        token_bytes(tokenizer)  # made now, not on the engine thread at the first request
        self.eos_token_ids = eos_token_ids
        self.publish = publish
        self.observer = observer
        self.between_steps = between_steps  # graph commits, warm start and stats saving, on the engine thread
        # Overlap: launch step t+1 before reading step t's tokens, so that the host's work on step t
        # (stop checks, detokenizing, publishing) runs while the device computes step t+1.
        # Not with speculative decoding: a draft is proposed from every token before it, so the step
        # before must be read first.
        self.overlap = overlap and scheduler.proposer is None
        self.constraints = constraints
        self.spec_stats = SpecDecodeStats()  # speculative decoding's totals since start
        self._in_flight: _InFlight | None = None  # launched, not yet collected (overlap only)
        self._stalled = False  # the last step ran nothing, had nothing in flight and ended nothing
        self._mask_ready = False  # a grammar mask a sequence waited for is done (it can run again)
        self._cond = threading.Condition()
        if constraints is not None:
            constraints.masks.on_ready = self._on_mask_ready
        # Requests are known inside the engine by a key unique to this submit, not by the client's
        # request id: a client may cancel and resubmit the same id before the engine has seen the abort.
        self._keys = itertools.count()
        # (key, request, sink, its matcher, a failure to publish instead, or _ABORTED)
        self._inbox: list[tuple[str, GenerationRequest, Sink, Any]] = []
        # Requests whose constraint the grammar workers prepare: key -> (request, sink, aborted meanwhile)
        self._preparing: dict[str, tuple[GenerationRequest, Sink, bool]] = {}
        self._aborts: list[str] = []
        self._pauses: list[tuple[str, bool]] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._outputs: dict[str, tuple[RequestOutput, Sink]] = {}
        self._step_events: list[tuple[Sink, RequestEvent]] = []  # built this step, not yet published
        self._kv_sink: Callable[[Any], None] | None = None  # receives each step's KvEventBatch
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set when a step failed; the engine is then dead
        self.last_progress = time.monotonic()
        self._tokens_read_at: float | None = None  # the last step that delivered tokens (None: no stream since)
        self._slow_steps = SlowSteps(slow_step_s)

    # ---- any thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="graphserve-engine", daemon=True)
        self._thread.start()

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.num_free_slots

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self._inbox) + len(self._preparing)

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(used, total) KV blocks: held by a running sequence (cached free blocks count as free)."""
        stats = self.scheduler.block_stats()
        return stats.used, stats.num_blocks

    @property
    def waiting_prompt_tokens(self) -> int:
        preparing = sum(len(r.prompt_token_ids) for r, _, _ in list(self._preparing.values()))
        return (self.scheduler.waiting_prompt_tokens + preparing
                + sum(len(r.prompt_token_ids) for _, r, _, _ in list(self._inbox)))

    def has_pending_work(self) -> bool:
        return bool(self._inbox or self._calls or self.scheduler.has_work() or self._in_flight)

    def busy(self) -> bool:
        """Pending work (requests queued, running or in flight, an operator call), or a stop asked
        for: what graph captures under tensor parallelism wait out."""
        return self._stopping or self.has_pending_work()

    def submit(self, request: GenerationRequest, sink: Sink, key: str | None = None) -> str:
        """Queue a request; returns the key that `abort` takes (made here unless the caller, which
        then keeps keys unique, gives one). Raises EngineStopped when the engine no longer accepts work.

        A request with a constraint waits for the grammar workers to compile it and compute its first
        mask (never on this thread or the engine's); one they refuse ends with ConstraintFailed (its
        fault) or EngineBusy (retry later) as its event."""
        constraint = request.sampling.constraint
        if constraint is not None and self.constraints is None:
            raise ValueError("this engine serves no structured outputs (no grammar compiler)")
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineStopped("the engine is not running")
            key = key if key is not None else f"{request.request_id}#{next(self._keys)}"
            if constraint is None:
                self._inbox.append((key, request, sink, None))
                self._cond.notify()
                return key
            self._preparing[key] = (request, sink, False)
        self.constraints.preparer.prepare(constraint, lambda result: self._prepared(key, result))
        return key

    def _prepared(self, key: str, result: Any) -> None:
        """A grammar worker's result for a request (a Matcher or the exception that refused it)."""
        with self._cond:
            entry = self._preparing.pop(key, None)
            if entry is None:  # the engine stopped and ended it meanwhile
                return
            request, sink, aborted = entry
            self._inbox.append((key, request, sink, _ABORTED if aborted else result))
            self._cond.notify()

    def publish_kv_events(self, sink: Callable[[Any], None]) -> None:
        """Publish KV events from now on: each step's KvEventBatch goes out with its events, as the
        pair (sink, batch). Call before `start`."""
        self._kv_sink = sink
        self.scheduler.kv.publish_events()

    def wake(self) -> None:
        """Run `between_steps` soon even when idle (a graph capture finished and waits to be committed)."""
        with self._cond:
            self._cond.notify()

    def abort(self, key: str) -> None:
        with self._cond:
            entry = self._preparing.get(key)
            if entry is not None:  # remembered: it ends when its constraint is ready
                self._preparing[key] = (entry[0], entry[1], True)
                return
            self._aborts.append(key)
            self._cond.notify()

    def pause(self, key: str, paused: bool) -> None:
        """Back-pressure: stop (or resume) decoding a request whose client has not read its tokens."""
        with self._cond:
            self._pauses.append((key, paused))
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (e.g. an admin operation on the graph cache)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.error is not None or self._stopping:
                future.set_exception(RuntimeError("the engine is not running"))
                return future
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def _on_mask_ready(self) -> None:
        """A grammar worker finished a mask that a sequence waited for (mask_fill.py)."""
        with self._cond:
            self._mask_ready = True
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # Stopped from its own thread (a garbage collection there released the owner): it ends after this step.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    # Work that the last step could not run (every slot held by a paused sequence, a
                    # request waiting behind them) waits for what can change that, not a spin.
                    while not (self._stopping or self._inbox or self._aborts or self._pauses or self._calls
                               or (self.scheduler.has_work() and not self._stalled) or self._in_flight
                               or self._mask_ready):
                        if not self.scheduler.has_work():
                            self.last_progress = time.monotonic()  # idle is not stuck
                        self._cond.wait(timeout=0.5)
                        if self.between_steps is not None:
                            break
                    if self._stopping:
                        self._fail_all("the server is shutting down")
                        break
                    self._mask_ready = False  # set again if one is done while this step runs
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    pauses, self._pauses = self._pauses, []
                    calls, self._calls = self._calls, []
                self._apply(inbox, aborts, pauses, calls)
                del inbox  # nothing of a request (its matcher above all) stays referenced while idle
                self.step()
                if self.between_steps is not None:
                    self.between_steps()
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine; streams must end
            self.error = exc
            log.error("engine_failed", error=repr(exc), exc_info=True)
            # Terminal events this step already built (their outputs are gone) still go out first.
            events, self._step_events = self._step_events, []
            self._publish_safely(events)
            self._fail_all(f"the engine failed: {exc!r}; the server is shutting down")
        finally:
            with self._cond:
                calls, self._calls = self._calls, []
            for _, future in calls:
                future.set_exception(RuntimeError("the engine stopped"))
            if self.constraints is not None:
                self.constraints.close()

    def _apply(self, inbox: list[tuple[str, GenerationRequest, Sink, Any]], aborts: list[str],
               pauses: list[tuple[str, bool]], calls: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        """What other threads queued since the last step: operator calls, new requests, aborts, pauses."""
        if calls:
            self._drain()  # operator calls see a quiet device and every token read
        for fn, future in calls:
            self._run_call(fn, future)
        refused: list[tuple[Sink, RequestEvent]] = []
        for key, request, sink, matcher in inbox:
            if matcher is _ABORTED or isinstance(matcher, Exception):
                refused.append((sink, _refusal(request, matcher)))
                continue
            if request.adapter and not self._hold_adapter(request.adapter, sink):
                continue
            seq = Sequence(request, key=key, matcher=matcher)
            self._outputs[key] = (RequestOutput(seq, self.tokenizer, self.eos_token_ids), sink)
            self.scheduler.add(seq)
        self._publish_safely(refused)
        for key in aborts:
            self.scheduler.abort(key)
        for key, paused in pauses:
            self.scheduler.pause(key, paused)

    def step(self) -> None:
        """Schedule and launch a step; then read and publish the tokens of the step launched before it
        (with overlap) or of this one (without)."""
        started = time.monotonic()
        scheduled = self.scheduler.schedule()
        now = time.monotonic()
        events = self._step_events = []
        for seq in self.scheduler.take_aborted():
            events.append(self._finish(seq, None, now))
        seqs = scheduled.sampling  # a chunk that leaves part of its prompt for later steps samples nothing
        if scheduled.speculative_k is not None:
            self.spec_stats.add_step(scheduled.speculative_k)
            if self.observer is not None:
                self.observer.on_speculative_k(scheduled.speculative_k)
        launched = None
        if not scheduled.empty:
            # A step with constrained rows: their masks need the tokens in flight, so the step in
            # flight is read after this step's forward pass is queued and before its sampling (the
            # host's work still overlaps the device's forward pass).
            if self._in_flight is not None and any(s.matcher is not None for s in seqs):
                in_flight, self._in_flight = self._in_flight, None

                def read_in_flight() -> None:
                    self._read_tokens(in_flight, events)
                    if in_flight.seqs:
                        self._tokens_read(time.monotonic())

                handle = self.runner.launch(scheduled, before_sampling=read_in_flight)
            else:
                handle = self.runner.launch(scheduled)
            launched = _InFlight(seqs, handle, {v.seq: v.draft for v in scheduled.verifies} or None,
                                 frozenset(self.runner.take_sat_out()))
            self._fail_constraints(self.runner.take_failed_constraints(), now, events)
            for seq in seqs:
                if seq in launched.sat_out:  # its token is void: the position is computed again next step
                    self.scheduler.rejected(seq, 1)
                else:
                    seq.num_pending += 1
        launched_at = time.monotonic()
        if self.overlap:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            self._read_tokens(launched, events)
            if launched.seqs:
                self._tokens_read(time.monotonic())
        self._slow_steps.step(scheduled, started, now, launched_at, time.monotonic())  # what a stall was made of
        kv = self.scheduler.kv.take_events()  # this step's and those of calls before it (None unless published)
        self._publish_step(events + [(self._kv_sink, kv)] if kv else events)
        if not self.scheduler.num_running:
            self._tokens_read_at = None  # idle time is no stream's gap
        if not scheduled.empty or events:
            self.last_progress = time.monotonic()
        self._stalled = scheduled.empty and not events and self._in_flight is None
        if self.observer is not None and (not scheduled.empty or events):
            self.observer.on_step(self.scheduler.num_running, self.num_waiting,
                                  len(scheduled.decodes) + len(scheduled.verifies),
                                  len(scheduled.prefills))

    def _tokens_read(self, now: float) -> None:
        if self._tokens_read_at is not None and self.observer is not None:
            self.observer.on_step_gap(now - self._tokens_read_at)
        self._tokens_read_at = now

    def _drain(self) -> None:
        """Read and publish the step in flight, if any."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return
        events = self._step_events = []
        self._read_tokens(launched, events)
        self._publish_step(events)

    def _publish_step(self, events: list[tuple[Sink, RequestEvent]]) -> None:
        self._step_events = []  # built and about to leave: the failure path must not send them again
        if events:
            self.publish(events)

    def _read_tokens(self, launched: _InFlight, events: list[tuple[Sink, RequestEvent]]) -> None:
        step = self.runner.collect(launched.launched)
        now = time.monotonic()
        for key, start, prompt_logprobs in step.prompt_logprobs:
            if key in self._outputs:  # not finished or aborted since
                self._outputs[key][0].on_prompt_logprobs(start, prompt_logprobs)
        logprobs = step.logprobs if step.logprobs is not None else [None] * len(step.token_ids)
        read: list[Sequence] = []
        if launched.drafts is None:
            for seq, token, token_logprobs in zip(launched.seqs, step.token_ids, logprobs, strict=True):
                if seq in launched.sat_out:
                    continue
                seq.num_pending -= 1
                self._read_token(seq, token, token_logprobs, now, events, read)
        else:
            self._read_verified(launched, step.token_ids, logprobs, now, events, read)
        if self.observer is not None and read:
            self.observer.on_tokens(read, now)

    def _read_verified(self, launched: _InFlight, token_ids: list[int], logprobs: list[Any], now: float,
                       events: list[tuple[Sink, RequestEvent]], read: list[Sequence]) -> None:
        """A step with verify rows: each one's tokens are the target's after each of its tokens; the
        draft's longest prefix that they repeat is accepted, then the target's token after it (the
        correction, or a bonus when all were accepted); each goes out as a decode's would, until one
        ends the request. The rejected positions' KV is rolled back."""
        assert launched.drafts is not None
        at = 0
        accepted_per_row = []
        for seq in launched.seqs:
            draft = launched.drafts.get(seq, ())
            targets = token_ids[at: at + 1 + len(draft)]
            rows = logprobs[at: at + 1 + len(draft)]
            at += 1 + len(draft)
            if seq in launched.sat_out:  # a constrained decode (constrained sequences draft nothing)
                continue
            seq.num_pending -= 1
            if draft:
                accepted = accepted_length(draft, targets)
                accepted_per_row.append(accepted)
                if seq.status is SequenceStatus.RUNNING:
                    self.scheduler.verified(seq, len(draft), accepted)
                targets = targets[: accepted + 1]
            for token, token_logprobs in zip(targets, rows):
                if not self._read_token(seq, token, token_logprobs, now, events, read):
                    break
        assert at == len(token_ids), (at, len(token_ids))
        if accepted_per_row:
            num_draft_tokens = sum(map(len, launched.drafts.values()))
            self.spec_stats.add(len(accepted_per_row), num_draft_tokens, accepted_per_row)
            if self.observer is not None:
                self.observer.on_speculation(len(accepted_per_row), num_draft_tokens, accepted_per_row)

    def _read_token(self, seq: Sequence, token: int, token_logprobs: Any, now: float,
                    events: list[tuple[Sink, RequestEvent]], read: list[Sequence]) -> bool:
        """One completion token of seq; False when seq no longer takes tokens (it ended)."""
        if seq.status is SequenceStatus.FINISHED or seq.aborted:
            return False  # finished or aborted after this step was launched: the token is surplus
        # (A preempted sequence, waiting again, keeps its token: its recompute starts from it.)
        seq.completion_token_ids.append(token)
        read.append(seq)
        output, sink = self._outputs[seq.key]
        event = output.on_token(token, now, token_logprobs)
        if event is None:
            return True
        if isinstance(event, Finish):
            self.scheduler.finish(seq)
            events.append(self._finish(seq, event, now))
            return False
        if isinstance(event, EngineError):  # its grammar gave up on this token
            self.scheduler.finish(seq)
            events.append(self._fail(seq, event, now))
            return False
        events.append((sink, event))
        return True

    def _hold_adapter(self, name: str, sink: Sink) -> bool:
        """Count a new stream of adapter `name` (unload waits for it); an unknown one ends the stream."""
        adapters = self.scheduler.adapters
        try:
            if adapters is None:
                raise AdapterNotFound(f"adapter {name!r}: this server serves no adapters (start it with --max-loras)")
            adapters.hold(name)
        except AdapterNotFound as exc:
            self._publish_safely([(sink, AdapterGone(str(exc)))])
            return False
        return True

    def _fail_constraints(self, failed: list[tuple[Sequence, str]], now: float,
                          events: list[tuple[Sink, RequestEvent]]) -> None:
        """End the sequences whose grammar mask failed in the launch: their tokens in it are surplus."""
        for seq, why in failed:
            if seq.status is SequenceStatus.FINISHED or seq.aborted:
                continue
            self.scheduler.finish(seq)
            log.warning("constraint_failed", request_id=seq.request_id, reason=why)
            events.append(self._fail(seq, ConstraintFailed(why, seq.request.sampling.constraint.kind), now))

    def _fail(self, seq: Sequence, error: EngineError, now: float) -> tuple[Sink, RequestEvent]:
        """End a running request with an error instead of a finish (the observer counts an abort)."""
        if isinstance(error, ConstraintFailed) and self.constraints is not None:
            self.constraints.failed(seq.request.sampling.constraint)
        sink, _ = self._finish(seq, None, now)
        return sink, error

    def _finish(self, seq: Sequence, finish: Finish | None, now: float) -> tuple[Sink, RequestEvent]:
        output, sink = self._outputs.pop(seq.key)
        seq.matcher = None  # its grammar's memory goes now, not when the last reference to seq does
        if seq.request.adapter:
            assert self.scheduler.adapters is not None
            self.scheduler.adapters.unhold(seq.request.adapter)
        finish = finish if finish is not None else output.abort(now)
        if self.observer is not None:
            self.observer.on_finish(seq, finish)
        return sink, finish

    def _run_call(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - the caller gets the exception through the future
            future.set_exception(exc)

    def _fail_all(self, message: str) -> None:
        """Every request still queued or running ends with an EngineError."""
        with self._cond:  # reentrant: also called with the lock held
            inbox, self._inbox = self._inbox, []
            preparing, self._preparing = self._preparing, {}
        pairs: list[tuple[Sink, RequestEvent]] = [(sink, EngineError(message)) for _, _, sink, _ in inbox]
        pairs += [(sink, EngineError(message)) for _, sink, _ in preparing.values()]
        pairs += [(sink, EngineError(message)) for _, sink in self._outputs.values()]
        self._outputs.clear()
        self._publish_safely(pairs)

    def _publish_safely(self, pairs: list[tuple[Sink, RequestEvent]]) -> None:
        if not pairs:
            return
        try:
            self.publish(pairs)
        except Exception:  # noqa: BLE001 - the event loop may already be gone at shutdown
            log.warning("engine_publish_failed", exc_info=True)


_ABORTED = object()  # in the inbox: the request was aborted while its constraint was prepared


def accepted_length(draft: tuple[int, ...], targets: list[int]) -> int:
    """How many of the draft's tokens the target's tokens repeat from the start (targets[j] is the
    target's token after the row's j-th token, so draft[j] stands while it equals targets[j]).

    Greedy rows: the longest prefix matching the target's argmax. Sampled rows: the target's token
    at each position is drawn with the sampler's noise of that token's index, as without
    speculation, so a draft token d stands with probability p(d), and the token emitted in its place
    is a draw from p conditioned on not being d: the speculative sampling rule for a draft that is
    a point mass (min(1, p/q) with q(d) = 1; on rejection, norm(max(0, p - q))). The output has the
    target's distribution, token for token the one the same seed gives without speculation."""
    n = 0
    for d, t in zip(draft, targets):
        if d != t:
            break
        n += 1
    return n


def _refusal(request: GenerationRequest, why: Any) -> RequestEvent:
    """The event that ends a request the grammar workers refused, or one aborted meanwhile."""
    if why is _ABORTED:
        return Finish(FinishReason.ABORT, len(request.prompt_token_ids), 0, seed=request.sampling.seed,
                      total_seconds=max(0.0, time.monotonic() - request.arrival_time))
    if isinstance(why, ConstraintsBusy):
        return EngineBusy(str(why))
    return ConstraintFailed(str(why), request.sampling.constraint.kind)
