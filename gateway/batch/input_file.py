"""A Batch API input file: JSONL, one request per line, checked whole at upload.

Each line is `{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`. Only the
envelope is checked here; the body is validated when its line runs, as an HTTP request's would
be, and a bad body lands in the batch's error file. Errors name the line number (1-based, as an
editor shows it) and never quote the input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.openai.completion_bodies import Kind
from gateway.openai.errors import ApiError, bad_request

ENDPOINTS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def kind(self) -> Kind:
        return ENDPOINTS[self.url]

    @classmethod
    def decode(cls, raw: str | bytes) -> BatchLine:
        """A stored line (checked at upload)."""
        data = json.loads(raw)
        return cls(data["custom_id"], data["url"], data["body"])


def invalid_file(message: str) -> ApiError:
    return bad_request(message, param="file", code="invalid_batch_file")


def parse_input(data: bytes, max_lines: int) -> list[str]:
    """The file's request lines (blank lines skipped), or a 400 naming the first bad line."""
    lines: list[str] = []
    seen: dict[str, int] = {}  # custom_id -> its line number
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.strip()
        if not raw:
            continue
        if len(lines) == max_lines:
            raise invalid_file(f"The file has more than {max_lines} requests.")
        try:
            text = raw.decode()
            line = json.loads(text)
        except (UnicodeDecodeError, ValueError):
            raise invalid_file(f"Line {number} is not valid JSON.") from None
        custom_id = _check_line(line, number)
        if custom_id in seen:
            raise invalid_file(
                f"Line {number}: 'custom_id' repeats the one of line {seen[custom_id]}; "
                f"each request needs its own."
            )
        seen[custom_id] = number
        lines.append(text)
    if not lines:
        raise invalid_file("The file holds no requests.")
    return lines


def _check_line(line: Any, number: int) -> str:
    if not isinstance(line, dict):
        raise invalid_file(f"Line {number} is not a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise invalid_file(
            f"Line {number}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters."
        )
    if line.get("method") != "POST":
        raise invalid_file(f"Line {number}: 'method' must be \"POST\".")
    if line.get("url") not in ENDPOINTS:
        raise invalid_file(f"Line {number}: 'url' must be one of {', '.join(ENDPOINTS)}.")
    if not isinstance(line.get("body"), dict):
        raise invalid_file(f"Line {number}: 'body' must be a JSON object.")
    return custom_id
