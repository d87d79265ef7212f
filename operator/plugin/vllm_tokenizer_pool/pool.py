"""A bounded pool of private tokenizer copies behind the original HF fast tokenizer object.

Why: an HF fast tokenizer wraps one Rust tokenizer whose truncation/padding state is set by
``set_truncation_and_padding`` right before every encode. Shared between threads, that state
races: tokenizers <= 0.22.2 raises ``RuntimeError: Already borrowed`` in the thread calling a
setter while another thread encodes; tokenizers >= 0.23.1 no longer raises but silently encodes
with the other thread's truncation/padding (wrong results).

Scheme: ``make_thread_safe(tok, copies)`` makes ``copies`` private copies of ``tok`` up front and
swaps ``tok.__class__`` *in place* for a subclass (so every holder of the object, e.g. vLLM's
multimodal processor, is protected; ``isinstance`` and the class name still hold). Every public
method, plus ``__call__`` and ``__len__``, borrows one free copy for the duration of the call, so
each Rust tokenizer is used by one thread at a time on any tokenizers version. It never deep-copies
on the hot path (vLLM's ``maybe_make_thread_pool`` does when its queue is empty, holding the GIL
~0.5 s per copy of a 151k vocabulary and growing to the peak number of callers).

Waiting is fair and bounded:
- Copies are handed to waiters in arrival order (a returned copy goes straight to the longest
  waiter). A plain queue lets the thread that just returned a copy, still holding the GIL, take
  it back: measured with 2 copies and 32 threads, 29 threads completed no call in 3 s.
- Callers on a thread that runs an asyncio event loop are served before worker threads: while
  they wait, the whole server waits.
- A copy held longer than ``hold_deadline_s`` (default 30 s: vLLM abandons a chat-template render
  after 30 s, and its thread keeps running with the copy) is written off: the next waiter gets a
  fresh copy instead, and the old one is dropped when it comes back. At most ``copies`` copies are
  written off at a time, so at most ``2 * copies + 1`` tokenizers are ever alive (the copies,
  their replacements and the original). A caller that finds no copy, no written-off slot and no
  copy due back within the deadline raises ``TimeoutError`` rather than waiting for ever.
The original's own Rust object is only used for attribute/property reads, which hold the GIL.

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

Private copies are made from the object's current state (its ``__dict__``, deep-copied), never
through its class's ``__reduce__``: vLLM's cached-tokenizer classes rebuild from the tokenizer as
first loaded, which would drop a ``chat_template`` or tokens added since.

Pickling or ``copy.deepcopy`` of a wrapped tokenizer yields a new wrapped tokenizer with its own
``copies`` copies; so does ``copy.copy`` (a shallow copy would share the original's Rust object
and pool, and diverge on mutation). Pickling goes through the unwrapped class: for vLLM's
cached-tokenizer classes (defined inside a function, so only picklable through their own
``__reduce__``) that is vLLM's rebuild from the tokenizer as first loaded, exactly as without the
pool. Only HF fast tokenizers are wrapped: instances of transformers' ``PreTrainedTokenizerFast``
(``TokenizersBackend`` in 5.x), whatever their Rust object is (vLLM's ``fastokens`` mode swaps in
a shim), or any object holding a ``tokenizers.Tokenizer``; others are returned unchanged. A
tokenizer already wrapped by vLLM's ``maybe_make_thread_pool`` is re-wrapped by this pool (vLLM's
unbounded copies are dropped).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from vllm_tokenizer_pool.copies import CopyPool

__all__ = ["borrow", "is_thread_safe", "make_thread_safe", "pool_size_from_env", "pool_stats"]

POOL_SIZE_ENV = "VLM_TOKENIZER_POOL_SIZE"
DEFAULT_HOLD_DEADLINE_S = 30.0  # vLLM's VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT default

# Public methods that change tokenizer state: applied to the original and to every copy.
_MUTATORS = frozenset(
    {"add_tokens", "add_special_tokens", "sanitize_special_tokens", "update_post_processor"}
)
# Dunder methods that read tokenizer state and so must run on a copy.
_ROUTED_DUNDERS = ("__call__", "__len__")
_VLLM_POOL_MARKER = "ThreadSafeHFTokenizerMixin"
_POOL_ATTR = "_vlm_tokenizer_pool"
_CLASS_ATTR = "_vlm_thread_safe_class"  # on the base class: its wrapper class, made once

_T = TypeVar("_T")


class ThreadSafeTokenizerMixin:
    """Marker base of every class made by ``make_thread_safe``."""


def is_thread_safe(tokenizer: object) -> bool:
    """True when ``tokenizer`` was wrapped by ``make_thread_safe``."""
    return isinstance(tokenizer, ThreadSafeTokenizerMixin)


def _is_fast(tokenizer: object) -> bool:
    with contextlib.suppress(ImportError):
        from transformers import PreTrainedTokenizerFast

        if isinstance(tokenizer, PreTrainedTokenizerFast):
            return True
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


def _state(tokenizer: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(tokenizer).items() if k != _POOL_ATTR}


def _private_copy(cls: type, state: dict[str, Any]) -> Any:
    """An independent tokenizer of ``cls`` with a deep copy of ``state``."""
    tok = object.__new__(cls)
    tok.__dict__.update(copy.deepcopy(state))
    return tok


def _routed(base: type, name: str) -> Callable[..., Any]:
    base_fn = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool: CopyPool = self.__dict__[_POOL_ATTR]
        if pool.owner == threading.get_ident():  # inside a mutation of this tokenizer
            return base_fn(self, *args, **kwargs)
        tok = pool.acquire()
        try:
            return getattr(tok, name)(*args, **kwargs)
        finally:
            pool.release(tok)

    method.__name__ = name
    method.__doc__ = base_fn.__doc__
    return method


def _mutator(base: type, name: str) -> Callable[..., Any]:
    base_fn = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool: CopyPool = self.__dict__[_POOL_ATTR]
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
        pool: CopyPool | None = self.__dict__.get(_POOL_ATTR)
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
        plain.__dict__.update(_state(self))
        pool: CopyPool = self.__dict__[_POOL_ATTR]
        return make_thread_safe, (plain, pool.size)

    return __reduce__


def _copy(self: Any) -> Any:
    """A shallow copy would share the original's Rust object and diverge on mutation."""
    return copy.deepcopy(self)


def _thread_safe_class(base: type) -> type:
    """The wrapper class of ``base``, kept on ``base`` itself: it lives and dies with it (vLLM
    makes a new cached-tokenizer class on every unpickle; a global table would keep them all)."""
    cls = base.__dict__.get(_CLASS_ATTR)
    if cls is not None:
        return cls
    namespace: dict[str, Any] = {
        "__setattr__": _setattr(base),
        "__reduce__": _reduce(base),
        "__copy__": _copy,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,  # what vLLM's /tokenizer_info reports
    }
    for name in [*dir(base), *_ROUTED_DUNDERS]:
        if name.startswith("_") and name not in _ROUTED_DUNDERS:
            continue
        attr = inspect.getattr_static(base, name, None)
        if not inspect.isfunction(attr):  # properties, class/static methods, data
            continue
        namespace[name] = (_mutator if name in _MUTATORS else _routed)(base, name)
    cls = type(base.__name__, (base, ThreadSafeTokenizerMixin), namespace)
    type.__setattr__(base, _CLASS_ATTR, cls)  # two racing first calls: either class works
    return cls


def make_thread_safe(
    tokenizer: _T, copies: int, *, hold_deadline_s: float = DEFAULT_HOLD_DEADLINE_S
) -> _T:
    """Make ``tokenizer`` (in place, and return it) safe to call from any number of threads.

    Makes ``copies`` private copies now; each call then runs on a free copy, waiting (in arrival
    order, at most ``hold_deadline_s``) when all are busy. A no-op for an already wrapped
    tokenizer or one that is not an HF fast tokenizer.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    if not hold_deadline_s > 0:
        raise ValueError(f"hold_deadline_s must be > 0, got {hold_deadline_s!r}")
    if is_thread_safe(tokenizer) or not _is_fast(tokenizer):
        return tokenizer
    base = _unpooled_class(type(tokenizer))
    state = _state(tokenizer)
    private = [_private_copy(base, state) for _ in range(copies)]
    if base is not type(tokenizer):
        tokenizer.__class__ = base  # drop vLLM's pool class

    def make_copy() -> Any:  # a replacement, from the original's state at that moment
        return _private_copy(base, _state(tokenizer))

    object.__setattr__(tokenizer, _POOL_ATTR, CopyPool(private, make_copy, hold_deadline_s))
    tokenizer.__class__ = _thread_safe_class(base)
    return tokenizer


def pool_stats(tokenizer: object) -> dict[str, int] | None:
    """Size, free copies, waiting callers and copies replaced after the hold deadline; None for a
    tokenizer that is not wrapped."""
    pool: CopyPool | None = getattr(tokenizer, "__dict__", {}).get(_POOL_ATTR)
    if pool is None:
        return None
    with pool.lock:
        return {
            "size": pool.size,
            "free": len(pool.free),
            "waiting": len(pool.waiters) + len(pool.loop_waiters),
            "replaced": pool.replaced,
        }


@contextlib.contextmanager
def borrow(tokenizer: _T) -> Iterator[_T]:
    """Hold one private copy of a wrapped tokenizer for several consecutive calls.

    The copy must not be mutated and must not escape the ``with`` block. Inside the block use
    the copy, not the wrapped tokenizer: its calls (and mutations) may wait for this very copy.
    For a tokenizer that is not wrapped, yields the tokenizer itself.
    """
    pool: CopyPool | None = getattr(tokenizer, "__dict__", {}).get(_POOL_ATTR)
    if pool is None:
        yield tokenizer
        return
    tok = pool.acquire()
    try:
        yield tok
    finally:
        pool.release(tok)


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
