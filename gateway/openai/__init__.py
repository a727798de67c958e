"""The OpenAI shapes: request models (pydantic), error bodies, structured outputs, tools, and the
response side (choices, log-probs, bodies and SSE chunks, tool calls read back)."""
