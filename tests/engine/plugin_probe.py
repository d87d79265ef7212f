"""Run inside a vLLM venv (one fresh process per scenario, by test_plugin_vllm.py).

Loads the plugin through vLLM's own plugin loader (our entry point), builds vLLM's real input
processor the way AsyncLLM does in the installed version, finds every tokenizer object it uses
(prompt tokenizer, multimodal processor tokenizer(s), the HF processor's tokenizer) and prints
one JSON report on the last stdout line. vLLM's log lines go to stdout/stderr as in production.

Usage: python plugin_probe.py MODEL_DIR [--renderer-workers N] [--fake-version V]
                              [--tokenizer-mode MODE] [--concurrency] [--no-plugin]
                              [--heartbeat HOLD_S]
--concurrency (0.21+) drives the renderer's own executors with mixed-truncation tokenizer calls
and chat-template renders instead, and checks that an event-loop call completes while every
renderer thread holds a copy. --heartbeat drives vLLM's own scheduler through two steps
instead, so the plugin's engine heartbeat logs what a real step loop shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import pickle
import sys
from pathlib import Path

import numpy as np


def _pool_size(tok: object) -> int | None:
    from vllm_tokenizer_pool import pool

    state = getattr(tok, "__dict__", {}).get(pool._POOL_ATTR)
    return None if state is None else state.size


def _describe(tok: object, plain_ids: list[int]) -> dict:
    from vllm_tokenizer_pool import is_thread_safe

    return {
        "id": id(tok),
        "cls": type(tok).__name__,
        "pooled": is_thread_safe(tok),
        "size": _pool_size(tok),
        "encodes_like_plain": tok("a picture of a dog")["input_ids"] == plain_ids,
    }


def _ident(fn: object) -> dict:
    return {"id": hex(id(fn)), "ours": bool(getattr(fn, "__vlm_tokenizer_pool__", False))}


def _patched_targets() -> dict[str, dict]:
    """Every patchable vLLM callable: its identity (a second register() must change nothing)
    and whether it is one of the plugin's wrappers."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm."):
            continue
        for attr in ("maybe_make_thread_pool",):
            fn = mod.__dict__.get(attr)
            if fn is not None:
                out[f"{name}.{attr}"] = _ident(fn)
        for cls_name in (
            "InputProcessingContext",
            "InputPreprocessor",
            "HfRenderer",
            "BaseRenderer",
            "Scheduler",  # the engine heartbeat's hook
        ):
            cls = mod.__dict__.get(cls_name)
            if isinstance(cls, type) and cls.__module__ == name:
                out[f"{name}.{cls_name}.__init__"] = _ident(cls.__init__)
    return out


def build_input_processor(model_dir: str, renderer_workers: int, tokenizer_mode: str = "auto"):
    """vLLM's engine-side input processor, built the way AsyncLLM builds it in this version."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    kwargs = {"model": model_dir, "dtype": "float32", "max_model_len": 256,
              "tokenizer_mode": tokenizer_mode}
    if renderer_workers > 1:  # 0.19+; vLLM refuses it with the multimodal processor cache on
        kwargs |= {"renderer_num_workers": renderer_workers, "mm_processor_cache_gb": 0}
    # device "cpu": with the plain vllm wheel (CUDA build) and no GPU, "auto" cannot infer one.
    vllm_config = VllmConfig(model_config=ModelConfig(**kwargs), device_config=DeviceConfig("cpu"))
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # 0.11
        from vllm.v1.engine.processor import Processor as InputProcessor
    params = inspect.signature(InputProcessor.__init__).parameters
    if "tokenizer" in params:  # 0.11 - 0.14
        try:  # what AsyncLLM calls: 0.14 (0.11's name is a deprecated stub there)
            from vllm.tokenizers import cached_tokenizer_from_config as make
        except ImportError:  # 0.11
            from vllm.transformers_utils.tokenizer import init_tokenizer_from_configs as make
        return InputProcessor(vllm_config, make(vllm_config.model_config))
    if "renderer" in params:  # 0.17+: AsyncLLM builds one renderer and hands it over
        from vllm.renderers import renderer_from_config

        return InputProcessor(vllm_config, renderer_from_config(vllm_config))
    return InputProcessor(vllm_config)


def mm_processors(ip) -> list:
    renderer = getattr(ip, "renderer", None)
    if renderer is not None and hasattr(renderer, "get_mm_processor"):  # 0.17+
        procs = [renderer.get_mm_processor()]
        readonly = getattr(renderer, "_readonly_mm_processor", None)  # 0.20
        return procs + ([readonly] if readonly is not None else [])
    return [ip.input_preprocessor._get_mm_processor()]  # 0.11 - 0.16


TEXTS = [
    "a picture of a dog " * 30,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "What is in the image? A cat, a dog and 42 birds. " * 9,
]
SETTINGS = [{}, {"truncation": True, "max_length": 7}, {"truncation": True, "max_length": 40},
            {"padding": "max_length", "max_length": 64, "truncation": True}]


def _live_tokenizers() -> int:
    from transformers import PreTrainedTokenizerBase

    gc.collect()
    return sum(isinstance(o, PreTrainedTokenizerBase) for o in gc.get_objects())


def concurrency(model_dir: str, workers: int, tokenizer_mode: str) -> dict:
    """Mixed-truncation calls and chat-template renders on the renderer's own executors, then an
    event-loop decode while every renderer thread holds a copy."""
    import asyncio
    import threading

    from transformers import AutoTokenizer

    from vllm_tokenizer_pool import borrow, pool_stats

    ip = build_input_processor(model_dir, workers, tokenizer_mode)
    renderer = ip.renderer
    tok = renderer.tokenizer
    executors = [renderer._executor]
    mm_executor = getattr(renderer, "_mm_executor", None)
    if mm_executor is not None and mm_executor is not renderer._executor:
        executors.append(mm_executor)
    reference = AutoTokenizer.from_pretrained(model_dir)
    for side in ("truncation_side", "padding_side"):  # vLLM truncates prompts from the left
        setattr(reference, side, getattr(tok, side))
    cases = [(t, s) for t in TEXTS for s in SETTINGS]
    expected = [reference([t, t[:50]], **s)["input_ids"] for t, s in cases]
    messages = [{"role": "user", "content": "Describe a quick brown fox."}]
    want_chat = tok.apply_chat_template(messages, tokenize=False)  # the renderer's own template
    out = {"renderer": type(renderer).__name__, "renderer_threads": workers,
           "backend": type(vars(tok).get("_tokenizer")).__name__,  # a shim with fastokens
           "executors": len(executors), "pool": pool_stats(tok), "errors": [], "wrong": 0}
    live_before = _live_tokenizers()

    def call(i: int) -> None:
        text, settings = cases[i % len(cases)]
        try:
            if i % 5 == 0:  # a chat-template render on the same tokenizer
                if tok.apply_chat_template(messages, tokenize=False) != want_chat:
                    out["wrong"] += 1
            elif tok([text, text[:50]], **settings)["input_ids"] != expected[i % len(cases)]:
                out["wrong"] += 1
        except Exception as exc:
            out["errors"].append(repr(exc))

    async def hammer() -> int:
        loop = asyncio.get_running_loop()
        calls = [loop.run_in_executor(executors[i % len(executors)], call, i)
                 for i in range(2000)]
        await asyncio.gather(*calls)
        return len(calls)

    out["calls"] = asyncio.run(hammer())
    out["live_tokenizers_growth"] = _live_tokenizers() - live_before

    async def loop_call_while_workers_busy() -> None:
        loop = asyncio.get_running_loop()
        release = threading.Event()
        holding = threading.Semaphore(0)

        def hold() -> None:
            with borrow(tok):
                holding.release()
                release.wait(60)

        held = [loop.run_in_executor(ex, hold) for ex in executors
                for _ in range(getattr(ex, "_max_workers", 1))]
        for _ in held:
            await loop.run_in_executor(None, holding.acquire)
        out["held_by_renderer_threads"] = len(held)
        out["free_while_held"] = pool_stats(tok)["free"]
        ids = reference("a picture of a dog")["input_ids"]
        out["loop_decode_ok"] = tok.decode(ids) == reference.decode(ids)  # on the loop thread
        out["renderer_threads_still_holding"] = not release.is_set()
        release.set()
        await asyncio.gather(*held)

    if out["pool"] is not None:  # the plugin is loaded
        asyncio.run(loop_call_while_workers_busy())
    return out


def _accepted(target: object, kwargs: dict) -> dict:
    """kwargs less those `target` (a class or function) does not take in this vLLM."""
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_scheduler(model_dir: str):
    """vLLM's own scheduler, built the way EngineCore builds it, with a KV cache config
    of its own (no model, no device: only the scheduler's bookkeeping runs)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    block, blocks, max_len = 16, 1000, 256
    model_config = ModelConfig(model=model_dir, dtype="float32", max_model_len=max_len)
    scheduler_config = SchedulerConfig(**_accepted(SchedulerConfig, {
        "max_num_seqs": 4, "max_num_batched_tokens": max_len, "max_model_len": max_len,
        "is_encoder_decoder": False, "enable_chunked_prefill": True}))
    cache_config = CacheConfig(**_accepted(CacheConfig, {"block_size": block,
                                                         "enable_prefix_caching": False}))
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"))
    cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(**_accepted(FullAttentionSpec, {
        "block_size": block, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float32,
        "use_mla": False}))
    kv_cache_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(**_accepted(Scheduler.__init__, {
        "vllm_config": vllm_config, "kv_cache_config": kv_cache_config,
        "structured_output_manager": StructuredOutputManager(vllm_config),
        "log_stats": False, "block_size": block, "hash_block_size": block}))


def heartbeat(model_dir: str, prompt_tokens: int, hold_s: float) -> dict:
    """One real request through vLLM's scheduler: schedule() (a step is in flight with the
    prompt's tokens), `hold_s` standing in for the forward pass, update_from_output() with
    the sampled token; then a second step. The heartbeat lines go to vLLM's log (stdout)."""
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = build_scheduler(model_dir)
    request = Request(**_accepted(Request, {
        "request_id": "r0", "prompt_token_ids": list(range(1, prompt_tokens + 1)),
        "sampling_params": SamplingParams(max_tokens=3), "pooling_params": None,
        "eos_token_id": None, "arrival_time": time.time()}))
    scheduler.add_request(request)
    steps = []
    for _ in range(2):
        output = scheduler.schedule()
        steps.append(output.total_num_scheduled_tokens)
        time.sleep(hold_s)
        fields = {f.name: f.default for f in dataclasses.fields(ModelRunnerOutput)
                  if f.default is not dataclasses.MISSING}
        fields |= {"req_ids": ["r0"], "req_id_to_index": {"r0": 0},
                   "sampled_token_ids": [[7]], "logprobs": None, "prompt_logprobs_dict": {},
                   "pooler_output": []}
        scheduler.update_from_output(output, ModelRunnerOutput(**_accepted(
            ModelRunnerOutput, fields)))
        time.sleep(hold_s)
    from vllm_tokenizer_pool import heartbeat as hb

    return {"scheduled": steps, "hooked": bool(getattr(type(scheduler).__init__,
                                                       "__vlm_tokenizer_pool__", False)),
            "instrumented": getattr(scheduler, "__vlm_engine_heartbeat__", None) is not None,
            "running_waiting": list(hb.request_counts(scheduler))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--renderer-workers", type=int, default=1)
    parser.add_argument("--fake-version")
    parser.add_argument("--tokenizer-mode", default="auto")
    parser.add_argument("--concurrency", action="store_true")
    parser.add_argument("--no-plugin", action="store_true", help="plain vLLM (with VLLM_PLUGINS)")
    parser.add_argument("--heartbeat", type=float, metavar="HOLD_S",
                        help="drive vLLM's scheduler through two steps, each held this long")
    args = parser.parse_args()
    model_dir, fake = args.model_dir, args.fake_version
    import vllm

    if fake is not None:
        vllm.__version__ = fake
    from vllm.plugins import load_general_plugins

    from vllm_tokenizer_pool import plugin

    load_general_plugins()  # discovers our entry point, as every vLLM process does
    before = _patched_targets()
    if not args.no_plugin:
        plugin.register()  # twice more: must be a no-op
        plugin.register()
    report: dict = {
        "version": vllm.__version__,
        "second_register_noop": before == _patched_targets(),
    }
    if fake is not None:
        report["targets"] = before
        print(json.dumps(report))
        return

    if args.heartbeat is not None:
        report |= heartbeat(model_dir, 40, args.heartbeat)
        report["targets"] = _patched_targets()
        print(json.dumps(report))
        return

    if args.concurrency:
        report |= concurrency(model_dir, args.renderer_workers, args.tokenizer_mode)
        print(json.dumps(report))
        return

    from transformers import AutoTokenizer

    plain_ids = AutoTokenizer.from_pretrained(model_dir)("a picture of a dog")["input_ids"]
    ip = build_input_processor(model_dir, args.renderer_workers)
    renderer = getattr(ip, "renderer", None)  # 0.17+; before, the preprocessor holds it
    prompt_tok = renderer.tokenizer if renderer is not None else ip.input_preprocessor.tokenizer
    procs = mm_processors(ip)
    report["prompt"] = _describe(prompt_tok, plain_ids)
    report["mm"] = [_describe(p.info.ctx.tokenizer, plain_ids) for p in procs]
    hf_processor = procs[0].info.get_hf_processor()
    report["hf_processor"] = _describe(hf_processor.tokenizer, plain_ids)
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    out = hf_processor(text="<image>\nwhat is this?", images=[image], return_tensors="np")
    report["hf_processor_call_ok"] = "pixel_values" in out
    clone = pickle.loads(pickle.dumps(prompt_tok))
    report["pickled"] = None if clone is None else _describe(clone, plain_ids)
    report["targets"] = _patched_targets()
    print(json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
