"""The aiohttp app's shared state: the key under which every room's routes find the Gateway.

A module of its own so that a route module (generation, Batch API, live view, status) reads the
shared state without importing the request path or the app that wires them together.
"""

from __future__ import annotations

from aiohttp import web

from gateway.serving.gateway_state import Gateway

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
