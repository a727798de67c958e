"""The HTTP shell: the aiohttp app, its middleware, auth, rate limits, the routes, the server."""
