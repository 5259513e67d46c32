"""Turns one sequence's sampled tokens into the events its client sees.

Stops are checked here (stop token ids, EOS, stop strings, max_tokens), text is detokenized
incrementally, and tokens are grouped `stream_interval` at a time. A stop token or EOS ends the
completion without being streamed; it still counts in the usage.

`on_token` runs for every token of every stream on the engine thread: what a request does not use
(stop strings, logprobs, a grammar; text, when its client reads token ids only) costs it nothing
per token, and the limits are read once here.
"""

from __future__ import annotations

from typing import Any

import structlog

from service.engine.detokenizer import new_detokenizer
from service.engine.request import ConstraintFailed, Finish, FinishReason, RequestEvent, TokenDelta, TokenLogprobs
from service.engine.sequence import Sequence
from service.engine.stop import StopStringMatcher

log = structlog.get_logger("graphserve.engine")


class RequestOutput:
    def __init__(self, seq: Sequence, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.seq = seq
        request = seq.request
        p = request.sampling
        self._stop_ids = frozenset(p.stop_token_ids)
        self._end_ids = self._stop_ids | (frozenset() if p.ignore_eos else eos_token_ids)  # stop ids and EOS
        self._max_tokens = p.max_tokens
        self._interval = request.stream_interval
        self._stops = StopStringMatcher(p.stop) if any(p.stop) else None
        self._detokenizer = (new_detokenizer(tokenizer, request.prompt_token_ids)
                             if request.stream_text or self._stops is not None else None)
        self._pending_ids: list[int] = []
        self._pending_text = ""
        self._pending_logprobs: list[TokenLogprobs] | None = [] if request.sampling.logprobs is not None else None
        self._min_tokens = request.sampling.min_tokens
        # Prompt logprobs, one per prompt token after the first, filled by position as chunks compute
        # them (a recompute after a preemption writes the same positions again); sent with the first delta.
        asked = request.sampling.prompt_logprobs is not None
        self._prompt_logprobs: list[TokenLogprobs | None] | None = [None] * (seq.num_prompt_tokens - 1) if asked else None

    def on_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """The log-probabilities of prompt tokens start + 1, start + 2, ... (from a prefill chunk)."""
        if self._prompt_logprobs is None:  # sent already (a recompute after the first token)
            return
        self._prompt_logprobs[start: start + len(logprobs)] = logprobs

    def on_token(self, token: int, now: float, logprobs: TokenLogprobs | None = None) -> RequestEvent | None:
        """Record one sampled token (already appended to the sequence) and its log-probabilities.
        Returns the event to publish, if any: a Finish when the request is over, ConstraintFailed when
        its grammar gave up."""
        seq, request = self.seq, self.seq.request
        if seq.first_token_at is None:
            seq.first_token_at = now
        matcher = seq.matcher
        if matcher is not None and not matcher.accept(token):
            # The mask allowed it: the grammar library gave up (a limit it hit on this token). The
            # output so far does not follow the constraint to an end: an error, never a finish.
            log.warning("grammar_rejected_token", request_id=seq.request_id, token=token, error=matcher.error)
            return ConstraintFailed(f"the grammar library gave up on it after {len(seq.completion_token_ids) - 1} "
                                    f"tokens: {matcher.error or 'it rejected a token its mask allowed'}",
                                    request.sampling.constraint.kind)
        if token in self._end_ids:
            if token in self._stop_ids:
                return self._finish(FinishReason.STOP, now, matched=token)
            return self._finish(FinishReason.EOS, now)
        self._pending_ids.append(token)
        if self._pending_logprobs is not None:
            assert logprobs is not None, "a request with logprobs got a token without them"
            self._pending_logprobs.append(logprobs)
        num_tokens = len(seq.completion_token_ids)
        if self._detokenizer is not None:
            text = self._detokenizer.add([token])
            # Stop strings are looked for in the text after the first min_tokens tokens, as the
            # sampler bans stop ids and EOS until then.
            if self._stops is not None and num_tokens > self._min_tokens:
                text, matched = self._stops.feed(text)
                if matched is not None:
                    self._pending_text += text
                    return self._finish(FinishReason.STOP, now, matched=matched, flush=False)
            self._pending_text += text
        if num_tokens >= self._max_tokens:
            return self._finish(FinishReason.LENGTH, now)
        if matcher is not None and matcher.is_terminated:
            return self._finish(FinishReason.STOP, now)  # the grammar is complete: only EOS could follow
        if len(self._pending_ids) >= self._interval:
            return self._take_delta()
        return None

    def abort(self, now: float) -> Finish:
        return self._finish(FinishReason.ABORT, now)

    def _take_delta(self) -> TokenDelta:
        prompt = self._prompt_logprobs
        if prompt is not None:
            assert all(lp is not None for lp in prompt), "the first token came before its prompt's logprobs"
            self._prompt_logprobs = None
        delta = TokenDelta(self._pending_ids, self._pending_text, self._pending_logprobs, prompt)
        self._pending_ids, self._pending_text = [], ""
        if self._pending_logprobs is not None:
            self._pending_logprobs = []
        return delta

    def _finish(self, reason: FinishReason, now: float, matched: str | int | None = None, flush: bool = True) -> Finish:
        if flush and self._detokenizer is not None:
            # Text held back (an incomplete character, a possible stop prefix) is settled now.
            text = self._detokenizer.flush()
            if self._stops is None:
                self._pending_text += text
            else:
                text, late_match = self._stops.feed(text)
                self._pending_text += text
                if late_match is not None and reason is not FinishReason.ABORT:
                    reason, matched = FinishReason.STOP, late_match
                elif late_match is None:
                    self._pending_text += self._stops.flush()
        seq, request = self.seq, self.seq.request
        scheduled = seq.scheduled_at if seq.scheduled_at is not None else now
        first = seq.first_token_at if seq.first_token_at is not None else now
        # The prompt logprobs still go out when the first token ended it (not after an abort: they
        # may not all be computed).
        prompt_unsent = self._prompt_logprobs is not None and reason is not FinishReason.ABORT
        final = self._take_delta() if (self._pending_ids or self._pending_text or prompt_unsent) else None
        return Finish(
            reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            matched_stop=matched,
            cached_tokens=seq.num_cached_tokens,
            queue_seconds=max(0.0, scheduled - request.arrival_time),
            time_to_first_token_seconds=max(0.0, first - request.arrival_time),
            total_seconds=max(0.0, now - request.arrival_time),
            seed=request.sampling.seed,
            final_delta=final,
        )
