"""Structured output: a constrained request's grammar, and the tokens it allows next.

A request with ``SamplingParams.structured`` gets a grammar (xgrammar) compiled from its JSON
schema, regex, choice list, EBNF or Lark grammar, or structural tag, on a thread of its own,
so that a slow compile never holds up the steps of the running batch; the request waits
meanwhile. Once admitted, it has a matcher that takes each of its sampled tokens as the step
results arrive, and before each step that samples for it, writes the bitmask of the tokens
that may come next into the step plan; the sampling worker sets every other token's logit
to -inf.

xgrammar, and the torch and transformers it imports, load with the first constrained
request: a server that never gets one keeps the scheduler small. The tokenizer's vocabulary
is read then too, with the model's vocabulary size (the logits' width, which may exceed the
tokenizer's) and its EOS ids as the tokens that end a finished grammar.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pegainfer.gc_control import GC_FREEZE_ENV
from pegainfer.process import release_free_heap
from pegainfer.protocol import StructuredOutput
from scheduler_proc.grammar_install import unavailable_reason
from scheduler_proc.lark import is_lark, lark_to_ebnf
from scheduler_proc.repeat_unroll import unroll_ebnf, unroll_regex, unroll_schema_patterns

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# A run of whitespace inside JSON is cut at this many characters: allowed anywhere, any
# whitespace would let a model stall in it for the rest of its tokens.
MAX_JSON_WHITESPACE = 16
GRAMMAR_THREADS_ENV = "PEGAINFER_GRAMMAR_THREADS"
# xgrammar's errors begin with the time and its source line: "[03:36:14] /path/file.cc:94: ".
# A failed check adds its condition: "Check failed: (...) is false: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """The request's constraint does not compile; the message says why (for a 400)."""


class CompilerBusy(RuntimeError):
    """Overrun compiles still hold ``MAX_ABANDONED`` threads: no new one starts (a 503)."""


# Compiles abandoned at their deadline that may still run, each on a thread (and a core) of
# its own, before new constraints are turned away.
MAX_ABANDONED = 2


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices``."""
    # JSON string syntax is also EBNF string-literal syntax (the same escapes).
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class CompileJob:
    """One constraint's compile: its future, and when the thread took it up (None before)."""

    def __init__(self, structured: StructuredOutput) -> None:
        self.structured = structured
        self.started_at: float | None = None
        self.future: Future = Future()

    def run(self, compiler: GrammarCompiler) -> Any:
        compiler.backend()  # loading xgrammar and the vocabulary is not this compile's time
        self.started_at = time.monotonic()
        return compiler.compile(self.structured)


class GrammarCompiler:
    """Compiles constraints on a background thread; ``submit`` returns at once. A compile
    that overran its deadline is left to finish on its thread, unawaited, and the compiles
    queued behind it move to a fresh thread (``abandon_running``)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._executor: ThreadPoolExecutor | None = None
        self._queued: list[CompileJob] = []
        self._abandoned: list[CompileJob] = []
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on the thread
        # Why the backend could not be loaded, once it failed: every later constraint is
        # refused with it at once. A missing or broken package does not mend while the
        # process runs, and each try would cost a thread's import and a logged traceback.
        self.unavailable: str | None = None
        self._lock = threading.Lock()
        self.num_abandoned = 0

    def submit(self, structured: StructuredOutput) -> CompileJob:
        """The compile of ``structured``; its future raises ``GrammarError`` if it cannot
        be compiled. ``CompilerBusy`` while too many overrun compiles still run."""
        if self.unavailable is not None:
            raise GrammarError(self.unavailable)
        self._abandoned = [job for job in self._abandoned if not job.future.done()]
        if len(self._abandoned) >= MAX_ABANDONED:
            raise CompilerBusy(
                f"{len(self._abandoned)} constraints that overran --grammar-compile-timeout "
                "are still compiling; try again later"
            )
        job = CompileJob(structured)
        self._start(job)
        return job

    def _start(self, job: CompileJob) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        job.future = self._executor.submit(job.run, self)
        self._queued = [queued for queued in self._queued if not queued.future.done()]
        self._queued.append(job)

    def abandon_running(self) -> None:
        """Leave the running compile to its thread; the ones queued behind it start on a new
        one (xgrammar's compiler takes compiles from several threads at once)."""
        old = self._executor
        self._executor = None
        self.num_abandoned += 1
        self._abandoned += [
            job for job in self._queued if job.started_at is not None and not job.future.done()
        ]
        waiting = [job for job in self._queued if job.started_at is None and job.future.cancel()]
        self._queued = []
        if old is not None:
            old.shutdown(wait=False)
        for job in waiting:
            self._start(job)

    def compile(self, structured: StructuredOutput) -> Any:
        compiler = self.backend()
        kind, spec = structured.kind, structured.spec
        # Compact JSON: the separators' single spaces, none elsewhere.
        whitespace = (
            {"any_whitespace": False}
            if structured.compact_json
            else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        )
        try:
            if kind == "json":
                return compiler.compile_json_schema(_unrolled_schema(spec), **whitespace)
            if kind == "json_object":
                # Any object: strict mode would close objects without properties to "{}".
                return compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, **whitespace
                )
            if kind == "regex":
                return compiler.compile_regex(unroll_regex(spec))
            if kind == "choice":
                choices = json.loads(spec)
                return compiler.compile_grammar(choice_grammar(choices))
            if kind == "grammar":
                import xgrammar

                ebnf = lark_to_ebnf(spec) if is_lark(spec) else spec
                return compiler.compile_grammar(unroll_ebnf(xgrammar, ebnf))
            if kind == "structural_tag":
                return compile_structural_tag(compiler, json.loads(spec))
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _LOG_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"the {kind} constraint does not compile: {reason}") from None
        raise GrammarError(f"unknown structured output kind {kind!r}")

    def backend(self) -> Any:
        """xgrammar's compiler over the model's vocabulary, loaded by the first call; a
        ``GrammarError`` naming the cause if it cannot be loaded, then and ever after."""
        with self._lock:
            if self._compiler is None and self.unavailable is None:
                try:
                    self._compiler = self._make_compiler()
                except Exception as exc:
                    self.unavailable = unavailable_reason(exc)
                    logger.error("%s; every constrained request gets a 400", self.unavailable)
            if self.unavailable is not None:
                raise GrammarError(self.unavailable)
            return self._compiler

    def _make_compiler(self) -> Any:
        # The imports build a few hundred thousand objects that are never garbage: with the
        # collector on, full collections would walk them again and again on the way, each
        # pausing the scheduler's loop too (pegainfer/gc_control.py). Frozen afterwards.
        started = time.monotonic()
        collecting = gc.isenabled()
        gc.disable()
        loaded = False
        try:
            import xgrammar

            imported = time.monotonic()
            info = read_tokenizer_info(
                xgrammar, self.tokenizer_dir, self.vocab_size, self.stop_token_ids
            )
            compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            # The vocabulary's temporary copies (the tokenizer, its JSON, the token list)
            # would stay resident as freed heap: about 150 MB of the scheduler for Qwen3's.
            release_free_heap()
            loaded = True
        finally:
            if collecting:
                # As the process froze its start-up heap (not, say, a test's interpreter).
                # Only after a load: a freeze makes whatever cyclic garbage the process
                # holds at that moment immortal, so one on every failed try leaked it.
                frozen = gc.get_freeze_count() and os.environ.get(GC_FREEZE_ENV, "1") != "0"
                if loaded and frozen:
                    gc.freeze()
                gc.enable()
        logger.info(
            "structured output ready in %.2f s (xgrammar imported in %.2f s, "
            "%d-token vocabulary read in %.2f s)",
            time.monotonic() - started,
            imported - started,
            self.vocab_size,
            time.monotonic() - imported,
        )
        return compiler

    def bitmask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def compile_structural_tag(compiler: Any, tag: dict[str, Any]) -> Any:
    """A structural tag in xgrammar's format, or in the older one of ``structures`` and
    ``triggers`` (frontend_proc/structured_output.py)."""
    import xgrammar

    if "structures" not in tag:
        # Its "pattern"s are regexes: a JSON schema's, or a regex content's.
        return compiler.compile_structural_tag(json.dumps(unroll_schema_patterns(tag)))
    tags = [
        xgrammar.StructuralTagItem(
            begin=structure["begin"],
            schema=json.dumps(unroll_schema_patterns(structure["schema"])),
            end=structure["end"],
        )
        for structure in tag["structures"]
    ]
    return compiler.compile_structural_tag(tags, tag["triggers"])


def _unrolled_schema(spec: str) -> str:
    """The schema with its string patterns in the forms quick to mask (repeat_unroll.py)."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec  # xgrammar's own error says what is wrong
    unrolled = unroll_schema_patterns(schema)
    return spec if unrolled == schema else json.dumps(unrolled)


def read_tokenizer_info(
    xgrammar: Any, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]
) -> Any:
    """xgrammar's view of the vocabulary, read from ``tokenizer.json`` with ``tokenizers``
    (as the tokenizer processes read it): loading the transformers tokenizer for it took
    seconds more, most of it in transformers' own checks of the folder."""
    from tokenizers import Tokenizer

    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as file:
        serialized = file.read()
    vocab = Tokenizer.from_str(serialized).get_vocab(with_added_tokens=True)
    # Ids past the tokenizer's vocabulary (the logits may be wider) stay empty: never allowed.
    encoded_vocab = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    # Byte-level, byte-fallback or raw, and whether a space is prepended, as xgrammar reads
    # them from the serialized tokenizer when given a transformers one.
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(serialized)
    return xgrammar.TokenizerInfo(
        encoded_vocab,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


class RequestGrammar:
    """One request's place in its grammar.

    With ``opens_after`` (a token id, not -1) the grammar sleeps until the output draws
    that token (a reasoning model's ``</think>``) and constrains the tokens after it."""

    __slots__ = ("matcher", "num_rejected", "opens_after", "_first_mask")

    def __init__(self, compiled: Any, opens_after: int = -1) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.num_rejected = 0
        self.opens_after = opens_after
        self._first_mask: bytes | None = None

    @property
    def asleep(self) -> bool:
        return self.opens_after >= 0

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the mask
        makes that impossible unless the grammar has already ended)."""
        if self.opens_after >= 0:
            if token_id == self.opens_after:
                self.opens_after = -1
            return True
        if self.matcher.is_terminated():
            return False
        accepted = self.matcher.accept_token(token_id)
        if not accepted:
            self.num_rejected += 1
        return accepted

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (int32 [rows, words])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def first_mask(self, buffer: BitmaskBuffer) -> bytes:
        """The bitmask of the grammar's first token (packed as ``BitmaskBuffer.pack``), made
        once: a sleeping grammar sends it with each new sequence of its request (the first,
        and one after each preemption)."""
        if self._first_mask is None:
            assert self.asleep, "only a sleeping grammar is still at its start"
            self._first_mask = buffer.pack([self])
        return self._first_mask


class BitmaskBuffer:
    """The step's bitmask rows, one array reused across steps, filled on up to
    ``max_threads`` threads (xgrammar's, outside the GIL): a row costs from tens of
    microseconds to a millisecond, by grammar and state."""

    def __init__(self, words: int, max_threads: int | None = None) -> None:
        self.words = words
        if max_threads is None:
            # Half the cores at most: the worker's host threads and the tokenizers need
            # the rest (on a 2-core machine, one thread).
            max_threads = int(os.environ.get(GRAMMAR_THREADS_ENV, 0)) or (os.cpu_count() or 2) // 2
        self.max_threads = max(1, min(max_threads, 8))
        self._buffer: Any = None
        self._batch: Any = None

    def pack(self, grammars: list[RequestGrammar | None]) -> bytes:
        """The rows' bitmasks, in order; a None row allows every token."""
        import torch
        import xgrammar

        rows = len(grammars)
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = torch.empty((max(rows, 8), self.words), dtype=torch.int32)
        filled = [(row, g.matcher) for row, g in enumerate(grammars) if g is not None]
        if len(filled) < rows:
            self._buffer[:rows] = -1
        if len(filled) == 1:
            filled[0][1].fill_next_token_bitmask(self._buffer, filled[0][0])
        elif filled:
            if self._batch is None:
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=self.max_threads)
            matchers = [matcher for _, matcher in filled]
            indices = [row for row, _ in filled]
            self._batch.batch_fill_next_token_bitmask(matchers, self._buffer, indices)
        return self._buffer[:rows].numpy().astype("<i4", copy=False).tobytes()
