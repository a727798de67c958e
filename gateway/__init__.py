"""The gateway: the OpenAI-compatible HTTP front door (aiohttp, no torch)."""
