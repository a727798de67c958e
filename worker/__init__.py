"""The worker: model, paged KV cache and the engine loop (one process per GPU or CPU)."""
