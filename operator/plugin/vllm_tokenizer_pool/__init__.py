"""Engine-side thread-safe tokenizer pool and its vLLM plugin (no kopf/kubernetes imports)."""

from vllm_tokenizer_pool.pool import (
    borrow,
    is_thread_safe,
    make_thread_safe,
    pool_size_from_env,
    pool_stats,
)

__all__ = ["borrow", "is_thread_safe", "make_thread_safe", "pool_size_from_env", "pool_stats"]
