"""The engine process's side of outputs: EngineCoreOutputs in, RequestOutputs to the user out.

For each request it detokenizes incrementally, checks stop strings (a match finishes the completion
here, and its id is returned so the engine core aborts it), turns logprobs into `Logprob` objects, keeps
the metrics, and builds RequestOutputs as `params.output_kind` asks:
- CUMULATIVE: every output carries all `n` completions so far;
- DELTA: only the completions that changed, with only their new text and token ids;
- FINAL_ONLY: one output with all `n` completions once every one has finished.
While a request runs, text that could be the start of a stop string is held back (see detokenizer).

With n > 1 the engine core runs one child request per completion, with ids `child_ids[i]` (the engine
names them f"{i}_{request_id}"); the parent's RequestOutput puts child i at CompletionOutput index i.
Without a tokenizer (skip_tokenizer_init) or with detokenize=False, text is "" and decoded_token None.
A failure while processing one request's update (detokenizing, a stop check, building its output) ends
that request alone, with finish reason "abort" and the reason in `error`, as a failure inside a step does.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from llmplug.core.params import RequestOutputKind, SamplingParams
from llmplug.engine.core_outputs import EngineCoreOutput, LogprobsLists
from llmplug.engine.detokenizer import IncrementalDetokenizer

__all__ = ["EngineCoreOutput", "LogprobsLists", "OutputProcessor", "ProcessedOutputs"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ProcessedOutputs:
    """What one `process` call produced."""

    request_outputs: list[RequestOutput]  # to hand to the user, one per request that has something new
    reqs_to_abort: list[str]  # child ids the engine core must abort: a stop string finished them here
    reqs_failed: list[str] = field(default_factory=list)  # child ids whose output processing failed: abort them


@dataclass(eq=False)
class CompletionState:
    """One completion (one engine-core child request) as the output processor tracks it."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0  # token ids already handed out (DELTA)
    logprobs: list[PositionLogprobs] | None = None
    num_sent_logprobs: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set when a failure in a step aborted it

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestState:
    """A user request: its prompt, parameters, completions and metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, CompletionState]  # child id -> completion
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True once every completion finished."""
        # read each step, several times per request: a plain loop, without a property call per completion
        for completion in self.children.values():
            if completion.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Turns engine-core outputs into RequestOutputs (in the engine process, next to the user)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer  # None: skip_tokenizer_init, token ids only
        self.requests: dict[str, RequestState] = {}
        self._parent_of: dict[str, str] = {}  # child id -> request id
        self._token_text: dict[int, str] = {}  # token id -> decoded text, for Logprob.decoded_token

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        child_ids: list[str],
        prompt_is_embeds: bool = False,
    ) -> None:
        """Start tracking a request whose `len(child_ids)` completions the engine core runs (`prompt_is_embeds`: its
        prompt ids are placeholders, no context for detokenizing the first generated tokens)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; ids must be unique")
        detokenize = params.detokenize and self.tokenizer is not None
        if params.stop and not detokenize:
            raise InvalidRequestError(
                f"request {request_id}: stop strings {params.stop} need detokenization; "
                "set detokenize=True and load a tokenizer, or use stop_token_ids"
            )
        children = {
            child_id: CompletionState(
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, [] if prompt_is_embeds else prompt_token_ids, params)
                if detokenize else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i, child_id in enumerate(child_ids)
        }
        self.requests[request_id] = RequestState(
            request_id, prompt, list(prompt_token_ids), params, children, RequestMetrics(arrival_time)
        )
        self._parent_of.update((child_id, request_id) for child_id in child_ids)

    def process(self, updates: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's engine-core outputs; return what to emit and which children to abort."""
        now = time.time()
        changed: dict[str, list[CompletionState]] = {}
        reqs_to_abort: list[str] = []
        failed: list[str] = []
        for update in updates:
            request_id = self._parent_of.get(update.req_id)
            if request_id is None:
                continue  # aborted meanwhile
            request = self.requests[request_id]
            completion = request.children[update.req_id]
            if completion.finished:
                continue  # a stop string finished it here; the core had not seen the abort yet
            try:
                if self._apply(request, completion, update, now) and update.finish_reason is None:
                    reqs_to_abort.append(update.req_id)
            except Exception as error:  # a detokenizer's or a stop check's failure: this completion ends, not the step
                _fail(completion, f"its output processing failed: {error!r}")
                failed.append(update.req_id)
            if update.new_token_ids or completion.finished:  # a prompt-logprobs chunk alone waits
                changed.setdefault(request_id, []).append(completion)
        outputs = []
        for request_id, completions in changed.items():
            output = self._guarded_output(self.requests[request_id], completions, failed)
            if output is not None:
                outputs.append(output)
            if self.requests[request_id].finished:
                self._forget(request_id)
        return ProcessedOutputs(outputs, reqs_to_abort, failed)

    def _guarded_output(self, request: RequestState, changed: list[CompletionState],
                        failed: list[str]) -> RequestOutput | None:
        """`_make_output`, guarded: when it raises, the request's unfinished completions end (their child ids go
        to `failed`) and the output says so, without text."""
        try:
            return self._make_output(request, changed)
        except Exception as error:  # the request cannot go on; the other requests of the step can
            why = f"its output failed to build: {error!r}"
            logger.error("request %s aborted: %s", request.request_id, why)
            for child_id, completion in request.children.items():
                if not completion.finished:
                    failed.append(child_id)
                completion.detokenizer = None  # the text is what failed: the last output holds none
                completion.error = completion.error or why
                completion.finish_reason = completion.finish_reason or "abort"
            return self._make_output(request, list(request.children.values()))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (by request id or child id) without output; return the child ids to abort in the core."""
        child_ids: list[str] = []
        for rid in request_ids:
            request_id = rid if rid in self.requests else self._parent_of.get(rid)
            if request_id is not None and request_id in self.requests:
                child_ids += [c for c, s in self.requests[request_id].children.items() if not s.finished]
                self._forget(request_id)
        return child_ids

    def has_unfinished_requests(self) -> bool:
        """True while any request is tracked."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """How many requests are tracked."""
        return len(self.requests)

    # --- applying one update ---

    def _apply(self, request: RequestState, completion: CompletionState, update: EngineCoreOutput, now: float) -> bool:
        """Fold one update into its completion; True when a stop string finished it here."""
        params = request.params
        _stamp(request.metrics, update, now)
        request.num_cached_tokens = max(request.num_cached_tokens, update.num_cached_tokens)
        if update.prompt_logprobs is not None:
            self._add_prompt_logprobs(request, update.prompt_logprobs)
        if update.new_logprobs is not None and completion.logprobs is not None:
            self._add_logprobs(completion, update.new_logprobs, params.logprobs)
        completion.token_ids += update.new_token_ids
        stopped_here = self._detokenize(completion, update, params)
        if update.finish_reason is not None and not completion.finished:
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
            completion.error = update.error
        if completion.finished and completion.detokenizer is not None:
            completion.detokenizer.flush()
        if request.finished:
            request.metrics.finished_time = now
        return stopped_here

    def _detokenize(self, completion: CompletionState, update: EngineCoreOutput, params: SamplingParams) -> bool:
        """Grow the text and check stop strings; True when a stop string finished the completion."""
        detok = completion.detokenizer
        if detok is None or completion.finished:
            return False
        token_ids = update.new_token_ids
        # A stop token (or EOS) ends the completion without its text, unless the user wants it.
        if update.finish_reason == "stop" and not params.include_stop_str_in_output and token_ids:
            token_ids = token_ids[:-1]
        stop = detok.check_stop(len(detok.update(token_ids)))
        if stop is None:
            return False
        completion.finish_reason, completion.stop_reason = "stop", stop
        return True

    def _add_logprobs(self, completion: CompletionState, lists: Any, num_logprobs: int) -> None:
        """Append one position per new token, trimmed to the request's top-k."""
        lists = lists.tolists()
        positions = self._positions(lists, num_logprobs, completion.detokenizer is not None)
        completion.logprobs.extend(positions)
        completion.cumulative_logprob += sum(row[0] for row in lists.logprobs)

    def _add_prompt_logprobs(self, request: RequestState, lists: Any) -> None:
        """Append the next chunk of prompt positions (the first position has none)."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        decode = request.params.detokenize and self.tokenizer is not None
        positions = self._positions(lists.tolists(), request.params.prompt_logprobs or 0, decode)
        request.prompt_logprobs.extend(positions)

    def _positions(self, lists: LogprobsLists, num_logprobs: int, decode: bool) -> list[PositionLogprobs]:
        """Logprob dicts of N positions: the chosen token (with its rank) and the top `num_logprobs`."""
        positions = []
        for ids, lps, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.selected_token_ranks):
            top_ids, top_lps = ids[1 : 1 + num_logprobs], lps[1 : 1 + num_logprobs]
            top = {t: Logprob(lp, j + 1, self._decoded(t, decode)) for j, (t, lp) in enumerate(zip(top_ids, top_lps))}
            positions.append({ids[0]: Logprob(lps[0], rank, self._decoded(ids[0], decode)), **top})
        return positions

    def _decoded(self, token_id: int, decode: bool) -> str | None:
        """The text of one token on its own, cached (None when not detokenizing)."""
        if not decode:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # --- building RequestOutputs ---

    def _make_output(self, request: RequestState, changed: list[CompletionState]) -> RequestOutput | None:
        """The RequestOutput to emit for a request after this step, or None when there is nothing to say."""
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = changed if delta else list(request.children.values())
        if len(completions) > 1:  # each once, in index order
            completions = sorted(set(completions), key=lambda c: c.index)
        outputs = [self._completion_output(c, delta) for c in completions]
        if delta:
            outputs = [o for o in outputs if o.text or o.token_ids or o.finish_reason is not None]
            if not outputs:
                return None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            prompt_logprobs=self._prompt_logprobs(request, delta),
            metrics=_snapshot(request.metrics),  # later steps must not change it
            num_cached_tokens=request.num_cached_tokens,
        )

    def _completion_output(self, completion: CompletionState, delta: bool) -> CompletionOutput:
        """One completion as the user sees it now (only what is new, when `delta`)."""
        text = ""
        if completion.detokenizer is not None:
            text = completion.detokenizer.get_next_output_text(completion.finished, delta)
        start = completion.num_sent_tokens if delta else 0
        log_start = completion.num_sent_logprobs if delta else 0
        completion.num_sent_tokens = len(completion.token_ids)
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[log_start:]
            completion.num_sent_logprobs = len(completion.logprobs)
        return CompletionOutput(
            index=completion.index,
            text=text,
            token_ids=completion.token_ids[start:],
            cumulative_logprob=completion.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            error=completion.error,
        )

    def _prompt_logprobs(self, request: RequestState, delta: bool) -> list[PositionLogprobs | None] | None:
        """All prompt logprobs, or (DELTA) only those not sent yet."""
        if request.prompt_logprobs is None:
            return None
        start = request.num_sent_prompt_logprobs if delta else 0
        request.num_sent_prompt_logprobs = len(request.prompt_logprobs)
        return request.prompt_logprobs[start:]

    def _forget(self, request_id: str) -> None:
        """Drop a finished or aborted request."""
        request = self.requests.pop(request_id)
        for child_id in request.children:
            self._parent_of.pop(child_id, None)


def _stamp(metrics: RequestMetrics, update: EngineCoreOutput, now: float) -> None:
    """Record when the request was first scheduled and when this step's tokens came (once per step: the
    children of an n > 1 request share the step's timestamp)."""
    if update.first_scheduled_time is not None:
        first = metrics.first_scheduled_time
        metrics.first_scheduled_time = update.first_scheduled_time if first is None else \
            min(first, update.first_scheduled_time)
    if not update.new_token_ids or metrics.last_token_time == now:
        return
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    else:
        metrics.inter_token_latencies.append(now - metrics.last_token_time)
    metrics.last_token_time = now


_metrics_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestMetrics)))


def _snapshot(metrics: RequestMetrics) -> RequestMetrics:
    """A shallow copy of `metrics` (as copy.copy makes it, several times faster: one per output and step)."""
    return RequestMetrics(*_metrics_fields(metrics))


def _fail(completion: CompletionState, why: str) -> None:
    """End a completion whose output processing raised: finish reason "abort", the reason in `error`."""
    logger.error("a completion was aborted: %s", why)
    completion.finish_reason, completion.error = "abort", why
    completion.detokenizer = None  # its text is what failed: nothing more is decoded
