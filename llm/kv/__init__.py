"""The KV caches: per-layer K/V memory, a static batch's cache, the slot cache of continuous batching."""
