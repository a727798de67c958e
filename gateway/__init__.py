"""The gateway: the OpenAI-compatible HTTP front door (aiohttp, no torch), in four rooms, top
down: `http` (the app and its routes), `batch` (the Batch API), `serving` (the request path and
its shared state), `openai` (the request and response shapes)."""
