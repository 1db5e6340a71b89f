"""Guided decoding in the engine: choose a backend per request, compile off the step loop, build the bitmask.

`GuidedDecodingManager` (one per engine, engine process) resolves each request's constraint to a
backend (`decoding.guided_backend` or the request's own `backend`; `auto` picks, per request, the first
installed backend in `AUTO_ORDER` that supports the constraint), then checks and compiles it in a
thread pool, off the engine thread and the event loop, caching the compiled grammars by (backend,
constraint). Bad input is an InvalidRequestError (a 400 through the server, which awaits the compile
before queueing). What a backend builds whole and can grow exponentially (outlines' and
lm-format-enforcer's automata) is measured first in the grammar sandbox, under
`decoding.guided_compile_timeout_s` and `decoding.guided_max_states`, so that one client's regex costs
only its own request. Each request holds a `RequestGrammar`: the scheduler keeps the request out of the waiting queue until its grammar is ready, feeds the matcher
every sampled token and finishes the request when the matcher terminates; `grammar_bitmask` fills
the step's bitmask rows of the requests under a grammar (only those: no work for the others).
A constraint with `start_after_token_ids` (the end of a model's reasoning) leaves its request's tokens
free until the output has produced that sequence; its grammar applies from the next token on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from llmplug.core.config import DecodingConfig
from llmplug.core.errors import InvalidRequestError, PluginError
from llmplug.core.params import GuidedDecodingParams
from llmplug.core.plugins import PluginRegistry, get_registry
from llmplug.core.protocols import CompiledGrammar, GrammarMatcher, GuidedDecodingBackend
from llmplug.engine.grammar_sandbox import SandboxCrash, SandboxTimeout, run_sandboxed

if TYPE_CHECKING:
    from llmplug.engine.request import Request
    from llmplug.engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)

GROUP = "llmplug.guided_decoding"
AUTO_ORDER = ("xgrammar", "llguidance", "outlines", "lm_format_enforcer")  # fastest first; then third-party
CACHE_SIZE = 256  # compiled grammars kept


class RequestGrammar:
    """One request's grammar: the (shared) compile future, then the request's own matcher."""

    def __init__(self, future: Future[CompiledGrammar], start_after_token_ids: Sequence[int] = ()) -> None:
        self._future = future
        self._matcher: GrammarMatcher | None = None
        self._terminated = False  # whether the grammar is complete or rejected a token, as of the last accept
        self._start_after = tuple(start_after_token_ids)
        self._recent: deque[int] = deque(maxlen=len(self._start_after))  # the last output tokens, to spot it

    @property
    def active(self) -> bool:
        """True once the grammar applies (at once, or after the `start_after_token_ids` sequence)."""
        return not self._start_after

    @property
    def ready(self) -> bool:
        """True once compiling finished (successfully or not)."""
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        """Why compiling failed, once it finished; None on success."""
        return self._future.exception()

    @property
    def matcher(self) -> GrammarMatcher:
        """The request's matcher (made on first use, once the grammar is ready)."""
        if self._matcher is None:
            self._matcher = self._future.result().matcher()
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; a token the grammar forbids (all tokens masked) ends the request.
        Before the grammar applies, the token only counts towards the sequence that starts it. The matcher's
        termination is asked here too, so that whatever it raises meets the caller's per-request guard."""
        if not self.active:
            self._recent.append(token_id)
            if tuple(self._recent) == self._start_after:
                self._start_after = ()
            return
        if not self.matcher.accept_token(token_id):
            logger.warning("guided decoding: sampled token %d is not allowed by the grammar; stopping", token_id)
            self._terminated = True
        self._terminated = self._terminated or self.matcher.is_terminated()

    def is_terminated(self) -> bool:
        """True when the request must stop: the grammar is complete, or it rejected a token (as of `accept`)."""
        return self._terminated


def check_json_schema(schema: dict | bool) -> None:
    """InvalidRequestError when `schema` is not a valid JSON schema (by its meta-schema; backends differ in
    what they reject, some compile nonsense)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise InvalidRequestError(f"guided_decoding.json is not a valid JSON schema at {where}: {exc.message}") from None


def check_automaton(backend: GuidedDecodingBackend, constraint: GuidedDecodingParams, config: DecodingConfig) -> None:
    """InvalidRequestError when the automaton `backend` would build whole for `constraint` takes longer than
    `decoding.guided_compile_timeout_s` to build or has more than `decoding.guided_max_states` states.

    Measured in the grammar sandbox (a process killed past the budget), so a runaway regex costs that
    request its budget and nothing else. Backends without `automaton_states` build nothing that can run away.
    """
    measure = getattr(backend, "automaton_states", None)
    if measure is None or constraint.kind == "json_object":  # json_object's schema is fixed, not the client's
        return
    what = f"guided_decoding {constraint.kind} for the {backend.name} backend"
    budget = config.guided_compile_timeout_s
    try:
        states = run_sandboxed(measure, constraint, budget)
    except SandboxTimeout:
        raise InvalidRequestError(
            f"{what}: its automaton took longer than {budget:g} s to build (decoding.guided_compile_timeout_s, "
            "--guided-compile-timeout-s); simplify the constraint or use the xgrammar or llguidance backend"
        ) from None
    except SandboxCrash as exc:
        raise InvalidRequestError(f"{what}: building its automaton failed ({exc}); simplify the constraint") from None
    except Exception:  # noqa: BLE001 - the library rejects the constraint: validate() says why, in its words
        return
    if states > config.guided_max_states:
        raise InvalidRequestError(
            f"{what}: its automaton has {states} states, more than {config.guided_max_states} "
            "(decoding.guided_max_states, --guided-max-states); simplify the constraint or use the xgrammar "
            "or llguidance backend"
        )


def wait_for_any(grammars: Sequence[RequestGrammar], timeout: float) -> None:
    """Block until one of `grammars` is compiled or `timeout` seconds pass."""
    wait([g._future for g in grammars], timeout=timeout, return_when=FIRST_COMPLETED)


class GuidedDecodingManager:
    """Backends, validation, the compile thread pool and the compiled-grammar cache of one engine.

    Backends come from `registry`, the engine's (default, outside an engine: the process-wide one).
    """

    def __init__(
        self, tokenizer: Any | None, vocab_size: int, eos_token_id: int | None, config: DecodingConfig,
        registry: PluginRegistry | None = None, max_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.config = config
        self.registry = registry or get_registry()
        self._backends: dict[str, GuidedDecodingBackend] = {}
        self._backends_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache is also touched by the pool's done-callbacks
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="llmplug-grammar")

    def prepare(self, params: GuidedDecodingParams) -> Future[CompiledGrammar]:
        """Choose the backend and start checking and compiling in the pool (or reuse the cached future, shared).

        Cheap and safe on any thread: what depends on the constraint's content (its JSON schema's validity,
        the backend's parse, the automaton's size, the compile) runs in the pool, and its InvalidRequestError
        comes out of the future. Unknown backends and unsupported features are raised here.
        """
        if self.tokenizer is None or self.eos_token_id is None:
            raise InvalidRequestError("guided decoding needs the model's tokenizer and end-of-sequence token")
        outside = [t for t in params.start_after_token_ids if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"guided_decoding.start_after_token_ids {outside} are outside the vocabulary [0, {self.vocab_size})"
            )
        constraint = self.resolve(params)
        key = (constraint.backend, constraint.cache_key)  # as asked ("auto" too): a hit was validated before
        if len(key[1][1]) > self.config.max_constraint_chars:  # the constraint as JSON text
            raise InvalidRequestError(
                f"guided_decoding {constraint.kind} is {len(key[1][1])} characters as JSON, more than the engine's "
                f"limit of {self.config.max_constraint_chars} (decoding.max_constraint_chars)", param="guided_decoding"
            )
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        candidates = self._candidates(constraint)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._build, constraint, candidates)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        return future

    def _build(self, constraint: GuidedDecodingParams, candidates: list[GuidedDecodingBackend]) -> CompiledGrammar:
        """Check the constraint with the first candidate that accepts it, and compile it (on a pool thread)."""
        if constraint.kind == "json":
            check_json_schema(constraint.schema)
        return self._first_valid(constraint, candidates).compile(constraint)

    def resolve(self, params: GuidedDecodingParams) -> GuidedDecodingParams:
        """The constraint with the engine's defaults filled in (backend name, whitespace)."""
        return dataclasses.replace(
            params,
            backend=params.backend or self.config.guided_backend,
            whitespace_flexible=(
                not self.config.compact_json if params.whitespace_flexible is None else params.whitespace_flexible
            ),
        )

    def select(self, constraint: GuidedDecodingParams) -> GuidedDecodingBackend:
        """The backend for a resolved constraint, validated; InvalidRequestError says what is wrong."""
        return self._first_valid(constraint, self._candidates(constraint))

    def _candidates(self, constraint: GuidedDecodingParams) -> list[GuidedDecodingBackend]:
        """The backends that may serve a resolved constraint, in order: the one it names, or for `auto` every
        installed one that supports its feature (no look at its content: cheap)."""
        if constraint.backend != "auto":
            backend = self.backend(constraint.backend)
            feature = backend.unsupported_feature(constraint)
            if feature is not None:
                raise self._unsupported(constraint, feature, f"the {backend.name} backend")
            return [backend]
        installed = self._installed()
        if not installed:
            raise InvalidRequestError("guided decoding: no backend is installed; pip install 'llmplug[guided]'")
        capable = [b for b in installed if b.unsupported_feature(constraint) is None]
        if not capable:
            raise self._unsupported(constraint, installed[0].unsupported_feature(constraint), "any installed backend")
        return capable

    def _first_valid(self, constraint: GuidedDecodingParams,
                     candidates: Sequence[GuidedDecodingBackend]) -> GuidedDecodingBackend:
        """The first of `candidates` whose automaton fits the budget and that accepts the constraint."""
        errors = []
        for backend in candidates:
            try:
                check_automaton(backend, constraint, self.config)
                backend.validate(constraint)
                return backend
            except InvalidRequestError as exc:
                errors.append(str(exc))
        raise InvalidRequestError("; ".join(errors))

    def backend(self, name: str) -> GuidedDecodingBackend:
        """The backend registered as `name`, built on first use (InvalidRequestError when unknown or broken)."""
        with self._backends_lock:  # requests are prepared on the engine thread and the server's
            if name not in self._backends:
                try:
                    cls = self.registry.load(GROUP, name)
                except PluginError as exc:
                    raise InvalidRequestError(f"guided decoding backend {name!r} is not available: {exc}") from exc
                self._backends[name] = cls(self.tokenizer, self.vocab_size, self.eos_token_id)
            return self._backends[name]

    def _installed(self) -> list[GuidedDecodingBackend]:
        """Every backend that loads here, in `auto` order."""
        names = self.registry.names(GROUP)
        ordered = [n for n in AUTO_ORDER if n in names] + sorted(n for n in names if n not in AUTO_ORDER)
        installed = []
        for name in ordered:
            try:
                installed.append(self.backend(name))
            except InvalidRequestError as exc:
                logger.debug("guided decoding backend %s skipped by auto: %s", name, exc)
        return installed

    def _unsupported(self, constraint: GuidedDecodingParams, feature: str, who: str) -> InvalidRequestError:
        able = [b.name for b in self._installed() if b.unsupported_feature(constraint) is None]
        hint = f"backends that can: {', '.join(able)}" if able else "no installed backend can"
        return InvalidRequestError(f"guided decoding: {feature} is not supported by {who}; {hint}")

    def _forget_failed(self, key: tuple, future: Future[CompiledGrammar]) -> None:
        """A failed compile is not cached: the next request with that constraint tries again."""
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles finish first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def grammar_bitmask(
    scheduled: Sequence["ScheduledRequest"], guided: Mapping[str, "Request"], vocab_size: int
) -> tuple[torch.Tensor | None, dict[str, str]]:
    """The step's bitmask [num_sampling_requests, ceil(V / 32)] int32: -1 (all allowed) except guided rows,
    and the requests whose matcher raised (request id -> why; their rows stay all allowed, they must fail).

    Rows follow the order of the scheduled requests that sample, which is the order of the logits.
    The bitmask is None when no request of this step samples under a grammar that applies yet.
    """
    sampling = [s.req_id for s in scheduled if s.samples]
    rows = [(row, guided[req_id]) for row, req_id in enumerate(sampling)
            if req_id in guided and guided[req_id].grammar.active]
    if not rows:
        return None, {}
    bitmask = torch.full((len(sampling), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    failed: dict[str, str] = {}
    for row, request in rows:
        try:
            request.grammar.matcher.fill_bitmask(bitmask, row)
        except Exception as error:  # a backend's bug or limit: this request cannot go on, the batch can
            failed[request.request_id] = f"its grammar failed to give the allowed tokens: {error!r}"
            bitmask[row] = -1
    rows = [(row, request) for row, request in rows if request.request_id not in failed]
    if not rows:
        return bitmask, failed
    guided_rows = torch.tensor([row for row, _ in rows])
    stuck = guided_rows[~bitmask[guided_rows].any(dim=-1)].tolist()  # the grammar allows no token of the vocabulary
    if stuck:
        by_row = dict(rows)
        for row in stuck:
            _allow_end(bitmask, row, by_row[row])
    return bitmask, failed


def _allow_end(bitmask: torch.Tensor, row: int, request: "Request") -> None:
    """Let a request whose grammar allows no token of the vocabulary sample the end token (and so stop),
    rather than a row with every logit at -inf."""
    logger.warning("request %s: its grammar allows no token of the vocabulary here; ending it", request.request_id)
    eos = request.eos_token_ids[0]  # the tokenizer's: the one the grammar backends know
    bitmask[row, eos // 32] = torch.tensor(1 << (eos % 32), dtype=torch.int64).to(torch.int32)  # bit 31 wraps
