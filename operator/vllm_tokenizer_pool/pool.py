"""A bounded pool of private tokenizer copies behind the original HF fast tokenizer object.

Why: an HF fast tokenizer wraps one Rust tokenizer whose truncation/padding state is set by
``set_truncation_and_padding`` right before every encode. Shared between threads, that state
races: tokenizers <= 0.22.2 raises ``RuntimeError: Already borrowed`` in the thread calling a
setter while another thread encodes; tokenizers >= 0.23.1 no longer raises but silently encodes
with the other thread's truncation/padding (wrong results).

Scheme: ``make_thread_safe(tok, copies)`` deep-copies ``tok`` ``copies`` times up front and swaps
``tok.__class__`` *in place* for a subclass (so every holder of the object, e.g. vLLM's
multimodal processor, is protected; ``isinstance`` still holds). Every public method, plus
``__call__`` and ``__len__``, borrows one free copy from a ``queue.SimpleQueue`` for the duration
of the call, so each Rust tokenizer is used by one thread at a time on any tokenizers version.
When all copies are busy a caller blocks in ``SimpleQueue.get`` (C code, GIL released) until one
is returned: it never deep-copies on the hot path (vLLM's ``maybe_make_thread_pool`` does, holding
the GIL for ~0.5 s per copy of a 151k vocabulary and growing to the peak number of callers).
At most ``copies + 1`` tokenizers are alive: the copies and the original, whose own Rust object
is only used for attribute/property reads, which hold the GIL.

Why not copies keyed by truncation/padding settings (same-setting threads sharing one copy never
call a setter, so they never collide on 0.22 and are correct on 0.23's rwlock)? Measured with
bench/tokenizer_pool.py (bench/results/tokenizer-pool.md, 2 shared cores, 2 copies for the pool):
- steady state, 8k vocabulary, 5 settings: the keyed scheme did 1020-1400 calls/s against the
  pool's 1325-1760 (pool 1.1-1.5x faster: unbounded same-copy concurrency only adds GIL and
  Rust thread contention on 2 cores), with 6 tokenizers alive instead of 3;
- 48 distinct max_length values (vLLM truncates per request): keyed grew to 50 tokenizers and
  ~200 MB, at 570-610 calls/s, against the pool's 3 tokenizers, ~10 MB, 1370-1850 calls/s;
- 151k vocabulary: every new key deep-copies on the hot path (seconds with the GIL held), so the
  keyed scheme did 0-20 calls/s in 3 s windows and +460-590 MB;
- its correctness relies on transformers' private "compare, then set" logic in
  ``set_truncation_and_padding``, which differs between 4.x and 5.x.
The pool is correct by construction and bounded by ``copies``.

Mutations after wrapping:
- Propagated (applied to the original and every copy while holding all copies, so no call runs
  half-mutated): ``add_tokens``, ``add_special_tokens``, ``sanitize_special_tokens`` (4.x),
  ``update_post_processor`` (5.x), and assignment of any public attribute or property
  (``padding_side``, ``truncation_side``, ``model_max_length``, ``chat_template``, ``eos_token``,
  ``pad_token``, ``add_bos_token``...). They wait for in-flight calls to finish.
- Not propagated: in-place changes of mutable attributes (``tok.init_kwargs[...] = ...``,
  ``tok.model_input_names.append(...)``), private attributes (``tok._x = ...``), ``del tok.attr``,
  and anything done directly on the Rust object (``tok.backend_tokenizer`` / ``tok._tokenizer``,
  which is the original's, not a copy's: using it concurrently is not protected either).
- Consecutive calls may run on different copies (identical state, so identical results); use
  ``borrow(tok)`` to run several calls on one copy.

Pickling or ``copy.deepcopy`` of a wrapped tokenizer yields a new wrapped tokenizer with its own
``copies`` copies; so does ``copy.copy`` (a shallow copy would share the original's Rust object
and pool, and diverge on mutation). Tokenizers that are not HF fast tokenizers (no Rust
``tokenizers.Tokenizer``) are returned unchanged. A tokenizer already wrapped by vLLM's
``maybe_make_thread_pool`` is re-wrapped by this pool (vLLM's unbounded copies are dropped).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["borrow", "is_thread_safe", "make_thread_safe", "pool_size_from_env"]

POOL_SIZE_ENV = "VLM_TOKENIZER_POOL_SIZE"

# Public methods that change tokenizer state: applied to the original and to every copy.
_MUTATORS = frozenset(
    {"add_tokens", "add_special_tokens", "sanitize_special_tokens", "update_post_processor"}
)
# Dunder methods that read tokenizer state and so must run on a copy.
_ROUTED_DUNDERS = ("__call__", "__len__")
_VLLM_POOL_MARKER = "ThreadSafeHFTokenizerMixin"
_POOL_ATTR = "_vlm_tokenizer_pool"

_T = TypeVar("_T")


class ThreadSafeTokenizerMixin:
    """Marker base of every class made by ``make_thread_safe``."""


class _Pool:
    """The private copies; ``owner`` is the thread holding all of them during a mutation."""

    def __init__(self, copies: list[Any]) -> None:
        self.size = len(copies)
        self.free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for tok in copies:
            self.free.put(tok)
        self.owner: int | None = None
        self.mutation_lock = threading.Lock()

    @contextlib.contextmanager
    def all_copies(self) -> Iterator[list[Any]]:
        """Hold every copy (waiting for in-flight calls): the caller may mutate them all."""
        with self.mutation_lock:
            held = [self.free.get() for _ in range(self.size)]
            self.owner = threading.get_ident()
            try:
                yield held
            finally:
                self.owner = None
                for tok in held:
                    self.free.put(tok)


def is_thread_safe(tokenizer: object) -> bool:
    """True when ``tokenizer`` was wrapped by ``make_thread_safe``."""
    return isinstance(tokenizer, ThreadSafeTokenizerMixin)


def _is_fast(tokenizer: object) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    return isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer)


def _unpooled_class(cls: type) -> type:
    """The tokenizer class under vLLM's ``TokenizerPool<Cls>`` subclass(es), if any."""
    while any(base.__name__ == _VLLM_POOL_MARKER for base in cls.__bases__):
        cls = cls.__bases__[0]
    return cls


def _routed(base: type, name: str) -> Callable[..., Any]:
    base_fn = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool: _Pool = self.__dict__[_POOL_ATTR]
        if pool.owner == threading.get_ident():  # inside a mutation of this tokenizer
            return base_fn(self, *args, **kwargs)
        tok = pool.free.get()
        try:
            return getattr(tok, name)(*args, **kwargs)
        finally:
            pool.free.put(tok)

    method.__name__ = name
    method.__doc__ = base_fn.__doc__
    return method


def _mutator(base: type, name: str) -> Callable[..., Any]:
    base_fn = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool: _Pool = self.__dict__[_POOL_ATTR]
        if pool.owner == threading.get_ident():
            return base_fn(self, *args, **kwargs)
        with pool.all_copies() as held:
            result = base_fn(self, *args, **kwargs)  # first: an error leaves the copies as-is
            for tok in held:
                getattr(tok, name)(*args, **kwargs)
        return result

    method.__name__ = name
    method.__doc__ = base_fn.__doc__
    return method


def _setattr(base: type) -> Callable[[Any, str, Any], None]:
    base_setattr = base.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        pool: _Pool | None = self.__dict__.get(_POOL_ATTR)
        if pool is None or name.startswith("_") or pool.owner == threading.get_ident():
            base_setattr(self, name, value)
            return
        with pool.all_copies() as held:
            base_setattr(self, name, value)
            for tok in held:
                setattr(tok, name, value)

    return __setattr__


def _reduce(base: type) -> Callable[[Any], tuple[Any, ...]]:
    def __reduce__(self: Any) -> tuple[Any, ...]:
        plain = object.__new__(base)
        plain.__dict__.update((k, v) for k, v in self.__dict__.items() if k != _POOL_ATTR)
        return make_thread_safe, (plain, self.__dict__[_POOL_ATTR].size)

    return __reduce__


def _copy(self: Any) -> Any:
    """A shallow copy would share the original's Rust object and diverge on mutation."""
    return copy.deepcopy(self)


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _thread_safe_class(base: type) -> type:
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is not None:
            return cls
        namespace: dict[str, Any] = {
            "__setattr__": _setattr(base),
            "__reduce__": _reduce(base),
            "__copy__": _copy,
            "__module__": base.__module__,
            "__qualname__": f"ThreadSafe{base.__qualname__}",
        }
        for name in [*dir(base), *_ROUTED_DUNDERS]:
            if name.startswith("_") and name not in _ROUTED_DUNDERS:
                continue
            attr = inspect.getattr_static(base, name, None)
            if not inspect.isfunction(attr):  # properties, class/static methods, data
                continue
            namespace[name] = (_mutator if name in _MUTATORS else _routed)(base, name)
        cls = type(f"ThreadSafe{base.__name__}", (base, ThreadSafeTokenizerMixin), namespace)
        _CLASSES[base] = cls
        return cls


def make_thread_safe(tokenizer: _T, copies: int) -> _T:
    """Make ``tokenizer`` (in place, and return it) safe to call from any number of threads.

    Deep-copies it ``copies`` times now; each call then runs on a free copy, waiting for one
    when all are busy. A no-op for an already wrapped tokenizer or a non-fast tokenizer.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    if is_thread_safe(tokenizer) or not _is_fast(tokenizer):
        return tokenizer
    base = _unpooled_class(type(tokenizer))
    if base is not type(tokenizer):
        tokenizer.__class__ = base  # drop vLLM's pool: deep copies below must be plain
    private = [copy.deepcopy(tokenizer) for _ in range(copies)]
    object.__setattr__(tokenizer, _POOL_ATTR, _Pool(private))
    tokenizer.__class__ = _thread_safe_class(base)
    return tokenizer


@contextlib.contextmanager
def borrow(tokenizer: _T) -> Iterator[_T]:
    """Hold one private copy of a wrapped tokenizer for several consecutive calls.

    The copy must not be mutated and must not escape the ``with`` block. Inside the block use
    the copy, not the wrapped tokenizer: its calls (and mutations) may wait for this very copy.
    For a tokenizer that is not wrapped, yields the tokenizer itself.
    """
    pool: _Pool | None = getattr(tokenizer, "__dict__", {}).get(_POOL_ATTR)
    if pool is None:
        yield tokenizer
        return
    tok = pool.free.get()
    try:
        yield tok
    finally:
        pool.free.put(tok)


def pool_size_from_env(default: int) -> int:
    """The pool size from ``VLM_TOKENIZER_POOL_SIZE`` (int >= 1), or ``default`` when unset."""
    raw = os.environ.get(POOL_SIZE_ENV, "").strip()
    value: Any = default if raw == "" else raw
    source = f"{POOL_SIZE_ENV}={raw!r}" if raw else f"default pool size {default!r}"
    try:
        size = value if isinstance(value, int) and not isinstance(value, bool) else int(value)
    except ValueError:
        raise ValueError(f"{source} is not an integer; set an integer >= 1") from None
    if size < 1:
        raise ValueError(f"{source} must be >= 1")
    return size
