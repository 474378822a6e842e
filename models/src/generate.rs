//! Batched sampling with a KV cache.
