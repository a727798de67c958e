"""The request path without HTTP: prepare and submit a request, relay its replies, and the shared
state it runs on (Redis, the reply router, backlogs, served models, metrics)."""
