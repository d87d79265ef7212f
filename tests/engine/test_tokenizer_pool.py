"""make_thread_safe on real HF fast tokenizers (trained locally), under real thread contention.

Runs under hack/test-engine.sh in two venvs: tokenizers 0.22.2 + transformers 4.57 (unwrapped
tokenizer raises "Already borrowed") and tokenizers 0.23.x + transformers 5 (unwrapped tokenizer
returns wrong results). Each run asserts the failure mode of the version it runs under, proving
the harness reproduces the bug, then that the wrapped tokenizer never shows it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import gc
import os
import pickle
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import TypeVar

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_tokenizer_pool import (  # noqa: E402
    borrow,
    is_thread_safe,
    make_thread_safe,
    pool_size_from_env,
    pool_stats,
)
from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer, generated_text  # noqa: E402

OLD_TOKENIZERS = tuple(int(p) for p in tokenizers.__version__.split(".")[:2]) < (0, 23)
TEXTS = [" ".join(generated_text(400, seed=s)) for s in range(4)]  # long: wide race windows
SHORT = ["hello there", "chaing shoutra, plou!", "a", "the quick brown fox 12345"]
# Mixed truncation/padding settings: every switch between them calls a Rust setter.
SETTINGS = [
    {},
    {"truncation": True, "max_length": 7},
    {"truncation": True, "max_length": 64, "padding": "max_length"},
    {"padding": "longest"},
    {"truncation": True, "max_length": 33, "stride": 0},
]


@pytest.fixture(scope="module")
def base():
    return build_fast_tokenizer(8000)


@pytest.fixture
def plain(base):
    """A fresh unwrapped tokenizer (deep copy of the trained one)."""
    return copy.deepcopy(base)


@pytest.fixture
def reference(base):
    """A second unwrapped tokenizer, only ever used from the test thread."""
    return copy.deepcopy(base)


def _live(cls: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, cls))


def _cases():
    return [(i, text, kw) for i, (text, kw) in enumerate((t, k) for t in TEXTS for k in SETTINGS)]


def _expected(reference):
    return {i: reference([text, text[:200]], **kw)["input_ids"] for i, text, kw in _cases()}


def hammer(tok, expected, threads: int, seconds: float, stop_on_failure: bool):
    """Run mixed-settings batch encodes (and batch decodes) from ``threads`` threads."""
    cases = _cases()
    errors: list[str] = []
    wrong = [0]
    calls = [0]
    stop = threading.Event()
    start = threading.Barrier(threads)

    def worker(n: int) -> None:
        start.wait()
        k = n
        while not stop.is_set():
            i, text, kw = cases[k % len(cases)]
            k += threads + 1
            try:
                got = tok([text, text[:200]], **kw)["input_ids"]
                if got != expected[i]:
                    wrong[0] += 1
                if n % 4 == 0:
                    tok.batch_decode(got)
            except RuntimeError as e:
                errors.append(str(e))
            calls[0] += 1
            if stop_on_failure and (errors or wrong[0]):
                stop.set()

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.05)
    stop.set()
    for t in pool:
        t.join()
    return errors, wrong[0], calls[0]


def test_harness_reproduces_the_bug_on_an_unwrapped_tokenizer(plain, reference):
    errors, wrong, calls = hammer(plain, _expected(reference), 16, 30.0, stop_on_failure=True)
    if OLD_TOKENIZERS:
        assert any("Already borrowed" in e for e in errors), (errors[:3], wrong, calls)
    else:
        assert not errors, errors[:3]
        assert wrong > 0, f"no wrong result in {calls} calls"


@pytest.mark.parametrize("threads", [16, 32])
def test_wrapped_tokenizer_never_fails_under_contention(plain, reference, threads):
    expected = _expected(reference)
    tok = make_thread_safe(plain, copies=3)
    errors, wrong, calls = hammer(tok, expected, threads, 3.0, stop_on_failure=False)
    assert calls > threads
    assert errors == []
    assert wrong == 0


def test_public_calls_match_the_original(plain, reference):
    tok = make_thread_safe(plain, copies=2)
    assert isinstance(tok, type(reference))
    assert is_thread_safe(tok) and not is_thread_safe(reference)
    for kw in SETTINGS:
        assert tok(SHORT, **kw)["input_ids"] == reference(SHORT, **kw)["input_ids"]
        assert tok(SHORT[0], SHORT[1], **kw) == reference(SHORT[0], SHORT[1], **kw)
    for text in SHORT:
        ids = reference.encode(text)
        assert tok.encode(text) == ids
        assert tok.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )
        assert tok.decode(ids) == reference.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
        tokens = reference.tokenize(text)
        assert tok.tokenize(text) == tokens
        assert tok.convert_tokens_to_ids(tokens) == reference.convert_tokens_to_ids(tokens)
        assert tok.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert tok.convert_tokens_to_string(tokens) == reference.convert_tokens_to_string(tokens)
    batch = reference(SHORT)["input_ids"]
    assert tok.batch_decode(batch) == reference.batch_decode(batch)
    for name in ("batch_encode_plus", "encode_plus"):  # transformers 4.x only
        if hasattr(reference, name):
            arg = SHORT if name == "batch_encode_plus" else SHORT[1]
            assert getattr(tok, name)(arg) == getattr(reference, name)(arg)
    messages = [{"role": "user", "content": SHORT[1]}, {"role": "assistant", "content": "ok"}]
    for tokenize in (False, True):
        got = tok.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=True)
        want = reference.apply_chat_template(
            messages, tokenize=tokenize, add_generation_prompt=True
        )
        assert got == want
    assert tok.get_vocab() == reference.get_vocab()
    assert len(tok) == len(reference) == 8000
    assert tok.vocab_size == reference.vocab_size
    for attr in (
        "eos_token", "eos_token_id", "bos_token", "bos_token_id", "pad_token", "pad_token_id",
        "all_special_ids", "all_special_tokens", "special_tokens_map", "model_max_length",
        "padding_side", "truncation_side", "chat_template", "is_fast",
    ):  # fmt: skip
        assert getattr(tok, attr) == getattr(reference, attr), attr


def test_pickle_deepcopy_and_copy_give_working_thread_safe_tokenizers(plain, reference):
    tok = make_thread_safe(plain, copies=2)
    tok.padding_side = "left"
    reference.padding_side = "left"
    for clone in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok), copy.copy(tok)):
        assert clone is not None and clone is not tok
        assert is_thread_safe(clone) and isinstance(clone, type(reference))
        assert clone(SHORT, padding=True)["input_ids"] == reference(SHORT, padding=True)[
            "input_ids"
        ]
        clone.add_tokens(["zzqxw"])  # independent of the original, Rust object included
        assert len(clone) == len(tok) + 1 == 8001
        assert tok.backend_tokenizer.get_vocab_size() == 8000


def test_wrapping_twice_is_a_no_op(plain):
    tok = make_thread_safe(plain, copies=2)
    cls = type(tok)
    before = _live(type(tok).__mro__[1])
    assert make_thread_safe(tok, 5) is tok
    assert type(tok) is cls
    assert _live(type(tok).__mro__[1]) == before


def test_non_fast_tokenizers_are_returned_unchanged():
    thing = object()
    assert make_thread_safe(thing, 2) is thing
    assert not is_thread_safe(thing)


@pytest.mark.parametrize("copies", [0, -1, True, "2", 1.5])
def test_bad_copies_is_rejected(plain, copies):
    with pytest.raises(ValueError, match="copies"):
        make_thread_safe(plain, copies)


def test_bounded_copies_up_front_and_under_contention(plain, reference):
    cls = type(plain)
    before = _live(cls)
    tok = make_thread_safe(plain, copies=3)
    assert _live(cls) == before + 3  # the wrapped original + 3 private copies
    hammer(tok, _expected(reference), 32, 1.0, stop_on_failure=False)
    assert _live(cls) == before + 3


def test_a_caller_waits_for_a_free_copy_instead_of_copying(plain):
    cls = type(plain)
    tok = make_thread_safe(plain, copies=2)
    live = _live(cls)
    result: list[list[int]] = []
    with borrow(tok) as a, borrow(tok) as b:
        assert a is not b and not is_thread_safe(a)
        caller = threading.Thread(target=lambda: result.append(tok.encode("hello there")))
        caller.start()
        caller.join(0.5)
        assert caller.is_alive() and result == []  # blocked: no copy is free
        assert _live(cls) == live  # and it made none
    caller.join()
    assert result == [a.encode("hello there")]


WAIT_S = 60  # a bound on waiting for a thread's state (never a performance assertion)


def _until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _queue_callers(tok, n: int, done: list, on_loop=frozenset()) -> list[threading.Thread]:
    """Start callers one at a time, each queued before the next starts (arrival order known);
    callers whose index is in ``on_loop`` call from inside a running asyncio event loop. Each
    records itself while it holds the copy, so ``done`` is the order copies were handed out."""
    threads = []
    for i in range(n):
        waiting = pool_stats(tok)["waiting"]

        def take(i=i):
            with borrow(tok) as copy_:
                done.append(i)
                assert copy_.encode("hello there")

        def call(i=i):
            if i in on_loop:
                async def on_the_loop():
                    take()

                asyncio.run(on_the_loop())
            else:
                take()

        t = threading.Thread(target=call)
        t.start()
        threads.append(t)
        _until(lambda w=waiting: pool_stats(tok)["waiting"] == w + 1)
    return threads


def test_copies_go_to_waiters_in_arrival_order(plain):
    """A returned copy goes to the longest waiter (a plain queue let the returning thread take
    it back: 29 of 32 threads starved)."""
    tok = make_thread_safe(plain, copies=1)
    done: list[int] = []
    with borrow(tok):
        threads = _queue_callers(tok, 6, done)
    with borrow(tok):  # the thread that just returned the copy asks again at once
        done.append(-1)
    for t in threads:
        t.join(WAIT_S)
    assert done == [0, 1, 2, 3, 4, 5, -1]


def test_event_loop_callers_are_served_before_worker_threads(plain):
    tok = make_thread_safe(plain, copies=1)
    done: list[int] = []
    with borrow(tok):
        threads = _queue_callers(tok, 5, done, on_loop={3, 4})
    for t in threads:
        t.join(WAIT_S)
    assert done == [3, 4, 0, 1, 2]


def test_every_thread_completes_calls_under_contention(plain, reference):
    """32 threads on 2 copies: each completes a fixed number of calls (a starving pool hangs
    here until the deadline of the join and leaves threads alive)."""
    tok = make_thread_safe(plain, copies=2)
    counts = [0] * 32
    want = reference.encode(SHORT[3])

    def worker(n: int) -> None:
        for _ in range(30):
            assert tok.encode(SHORT[3]) == want
            counts[n] += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert counts == [30] * 32


def test_a_copy_held_past_the_deadline_is_replaced_then_dropped(plain, reference):
    """vLLM abandons a chat-template render after 30 s with its thread still running: the copy
    that thread holds is replaced for the next caller instead of blocking it for ever."""
    cls = type(plain)
    tok = make_thread_safe(plain, copies=1, hold_deadline_s=0.2)
    live = _live(cls)
    stuck = borrow(tok)
    stuck_copy = stuck.__enter__()  # an abandoned render, holding the only copy
    assert tok.encode(SHORT[1]) == reference.encode(SHORT[1])  # served by a replacement
    assert pool_stats(tok)["replaced"] == 1
    assert _live(cls) == live + 1  # the replacement, and the stuck copy still held
    stuck.__exit__(None, None, None)  # the abandoned render finishes at last
    del stuck_copy, stuck
    assert _live(cls) == live  # its copy was dropped: back to one copy
    assert tok.encode(SHORT[2]) == reference.encode(SHORT[2])


def test_when_nothing_can_be_replaced_a_caller_gets_an_error_not_a_hang(plain):
    tok = make_thread_safe(plain, copies=1, hold_deadline_s=0.2)
    # the copy, then its replacement, both held past the deadline
    with borrow(tok), borrow(tok), pytest.raises(TimeoutError, match="no tokenizer copy free"):
        tok.encode("hello")
    assert tok.encode("hello")  # and the pool works again once they come back


def test_the_class_keeps_its_name_and_lives_and_dies_with_its_base(plain):
    """vLLM's /tokenizer_info reports the class name; vLLM makes a new cached-tokenizer class
    on every unpickle, so the wrapper class must not be kept in a global table."""
    local = type("CachedLocal", (type(plain),), {})  # like vLLM's get_cached_tokenizer
    tok = copy.deepcopy(plain)
    tok.__class__ = local
    make_thread_safe(tok, copies=1)
    assert type(tok).__name__ == "CachedLocal" and type(tok).__mro__[1] is local
    gone = weakref.ref(local)
    del tok, local
    gc.collect()
    assert gone() is None


def test_copies_are_made_from_the_current_state_not_the_class_reduce(plain):
    """vLLM's cached-tokenizer classes pickle (and deep-copy) through a rebuild from the
    tokenizer as first loaded; a private copy must keep later changes."""
    first = copy.deepcopy(plain)

    class Cached(type(plain)):
        def __reduce__(self):
            return copy.deepcopy, (first,)

    plain.__class__ = Cached
    plain.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    plain.add_tokens(["zzqxw"])
    tok = make_thread_safe(plain, copies=2)
    with borrow(tok) as a, borrow(tok) as b:
        for c in (a, b):
            chat = c.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
            assert chat == "<x>"
            assert len(c) == 8001


def test_mutations_wait_for_in_flight_calls(plain):
    tok = make_thread_safe(plain, copies=2)
    with borrow(tok) as held:
        setter = threading.Thread(target=setattr, args=(tok, "padding_side", "left"))
        setter.start()
        setter.join(0.5)
        assert setter.is_alive()
        assert held.padding_side == "right"  # an in-flight call never sees a half mutation
    setter.join()
    with borrow(tok) as a, borrow(tok) as b:
        assert a.padding_side == b.padding_side == tok.padding_side == "left"


@pytest.mark.parametrize(
    ("attr", "value", "kwargs"),
    [
        ("padding_side", "left", {"padding": True}),
        ("truncation_side", "left", {"truncation": True, "max_length": 5}),
        ("model_max_length", 6, {"truncation": True}),
    ],
)
def test_setters_propagate_to_every_copy(plain, reference, attr, value, kwargs):
    tok = make_thread_safe(plain, copies=3)
    default = reference(SHORT, **kwargs)["input_ids"]
    setattr(tok, attr, value)
    setattr(reference, attr, value)
    want = reference(SHORT, **kwargs)["input_ids"]
    assert want != default  # sanity: the setting matters
    for _ in range(6):  # every copy in turn
        assert tok(SHORT, **kwargs)["input_ids"] == want
    with borrow(tok) as a, borrow(tok) as b, borrow(tok) as c:
        assert getattr(a, attr) == getattr(b, attr) == getattr(c, attr) == value


def test_token_and_template_mutations_propagate(plain, reference):
    tok = make_thread_safe(plain, copies=3)
    for t in (tok, reference):
        assert t.add_tokens(["zzqxw", "qqzzv"]) == 2
        t.add_special_tokens({"additional_special_tokens": ["<|video_pad|>"]})
        t.eos_token = "<|im_end|>"
        t.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    text = "ab zzqxw qqzzv <|video_pad|> cd"
    for _ in range(6):
        assert len(tok) == len(reference) == 8003
        assert tok.tokenize(text) == reference.tokenize(text)
        assert tok.encode(text) == reference.encode(text)
        assert tok.eos_token_id == reference.eos_token_id == reference.convert_tokens_to_ids(
            "<|im_end|>"
        )
        assert tok.all_special_ids == reference.all_special_ids
        msgs = [{"role": "user", "content": "x"}]
        assert tok.apply_chat_template(msgs, tokenize=False) == "[x]"


def test_in_place_changes_of_mutable_attributes_are_not_propagated(plain):
    """Documented limitation: only assignments and the listed mutator methods propagate."""
    tok = make_thread_safe(plain, copies=2)
    tok.init_kwargs["vlm_marker"] = 1
    with borrow(tok) as a:
        assert "vlm_marker" not in a.init_kwargs


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(min_size=0, max_size=80),
    setting=st.sampled_from(SETTINGS),
    skip_special=st.booleans(),
)
def test_any_text_round_trips_like_the_original(plain, reference, text, setting, skip_special):
    tok = plain if is_thread_safe(plain) else make_thread_safe(plain, copies=1)
    got = tok([text], **setting)["input_ids"]
    assert got == reference([text], **setting)["input_ids"]
    assert tok.decode(got[0], skip_special_tokens=skip_special) == reference.decode(
        got[0], skip_special_tokens=skip_special
    )


VLLM_HF = (
    Path(os.environ.get("VLM_CACHE", Path.home() / ".cache" / "vlm-operator"))
    / "vllm-src/0.24.0/vllm/tokenizers/hf.py"
)


@pytest.mark.skipif(not VLLM_HF.exists(), reason="run hack/tokenizer-envs.sh (vllm-src)")
def test_a_tokenizer_pooled_by_vllm_is_rewrapped_with_a_bounded_pool(plain, reference):
    """vLLM's own maybe_make_thread_pool (real 0.24.0 source), then ours on top."""
    tree = ast.parse(VLLM_HF.read_text())
    keep = {"ThreadSafeHFTokenizerMixin", "maybe_make_thread_pool"}
    tree.body = [n for n in tree.body if getattr(n, "name", None) in keep]
    ns = {"contextlib": contextlib, "copy": copy, "queue": queue, "_T": TypeVar("_T")}
    ns["PreTrainedTokenizerFast"] = transformers.PreTrainedTokenizerFast
    exec(compile(tree, str(VLLM_HF), "exec"), ns)
    base_cls = type(plain)
    vllm_pooled = ns["maybe_make_thread_pool"](plain, 2)
    assert type(vllm_pooled).__name__.startswith("TokenizerPool")
    tok = make_thread_safe(vllm_pooled, 2)
    assert tok is plain and is_thread_safe(tok)
    assert type(tok).__mro__[1] is base_cls  # vLLM's pool class is gone
    assert tok(SHORT, **SETTINGS[1])["input_ids"] == reference(SHORT, **SETTINGS[1])["input_ids"]
    clone = pickle.loads(pickle.dumps(tok))
    assert is_thread_safe(clone) and clone.encode(SHORT[0]) == reference.encode(SHORT[0])


def test_pool_size_from_env(monkeypatch):
    monkeypatch.delenv("VLM_TOKENIZER_POOL_SIZE", raising=False)
    assert pool_size_from_env(3) == 3
    monkeypatch.setenv("VLM_TOKENIZER_POOL_SIZE", " 8 ")
    assert pool_size_from_env(3) == 8
    monkeypatch.setenv("VLM_TOKENIZER_POOL_SIZE", "")
    assert pool_size_from_env(2) == 2
    for bad in ("0", "-2", "abc", "1.5"):
        monkeypatch.setenv("VLM_TOKENIZER_POOL_SIZE", bad)
        with pytest.raises(ValueError, match=f"VLM_TOKENIZER_POOL_SIZE='{bad}'"):
            pool_size_from_env(3)
    monkeypatch.delenv("VLM_TOKENIZER_POOL_SIZE")
    with pytest.raises(ValueError, match="default"):
        pool_size_from_env(0)
