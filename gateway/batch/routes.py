"""The Batch API's routes: /v1/files (upload, object, content, delete) and /v1/batches (create,
retrieve, list, cancel), in OpenAI's shapes. The lines run in gateway.batch.line_runner."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.app_state import GATEWAY
from gateway.batch.batch_store import COMPLETION_WINDOW_S, Batch, BatchStore
from gateway.batch.file_store import FileObject, FileStore
from gateway.batch.input_file import ENDPOINTS, parse_input
from gateway.openai.errors import ApiError, bad_request
from gateway.openai.validation import parse_json

UPLOAD_PATH = "/v1/files"
UPLOAD_PURPOSE = "batch"
MULTIPART_OVERHEAD = 64 * 1024  # a multipart body's boundaries and part headers, beyond the file
MAX_METADATA = 16  # OpenAI's limits on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_FILENAME = 256
LIST_LIMIT = 100


def _stores(request: web.Request) -> tuple[FileStore, BatchStore]:
    gw = request.app[GATEWAY]
    return FileStore(gw.redis, gw.keys), BatchStore(gw.redis, gw.keys)


def file_not_found() -> ApiError:
    return ApiError(404, "No such file.", param="file_id", code="file_not_found")


def batch_not_found() -> ApiError:
    return ApiError(404, "No such batch.", param="batch_id", code="batch_not_found")


# --- files ------------------------------------------------------------------------------------


async def upload_file(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not request.content_type.startswith("multipart/"):
        raise bad_request("Upload the file as multipart/form-data with 'file' and 'purpose'.")
    purpose, filename, data = None, "upload.jsonl", None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise bad_request("Nested multipart bodies are not supported.")
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace").strip()
            elif part.name == "file":
                filename = (part.filename or filename)[:MAX_FILENAME]
                data = await _read_limited(part, gw.config.max_file_bytes)
            else:
                await part.release()
    except (ValueError, AssertionError, RuntimeError, HttpProcessingError):  # a broken body
        raise bad_request("Malformed multipart/form-data body.") from None
    if purpose != UPLOAD_PURPOSE:
        raise bad_request("'purpose' must be \"batch\".", param="purpose")
    if data is None:
        raise bad_request("The upload has no 'file' part.", param="file")
    lines = await asyncio.to_thread(parse_input, data, gw.config.batch_max_lines)
    file = await _stores(request)[0].create(filename, purpose, lines)
    return web.json_response(file.to_json())


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"The file is larger than {limit} bytes.", param="file", code="file_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _file(request: web.Request) -> FileObject:
    file = await _stores(request)[0].get(request.match_info["file_id"])
    if file is None:
        raise file_not_found()
    return file


async def get_file(request: web.Request) -> web.Response:
    return web.json_response((await _file(request)).to_json())


async def file_content(request: web.Request) -> web.Response:
    file = await _file(request)
    body = await _stores(request)[0].content(file.id)
    return web.Response(body=body, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    file = await _file(request)
    await _stores(request)[0].delete(file.id)
    return web.json_response({"id": file.id, "object": "file", "deleted": True})


# --- batches ----------------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    body = parse_json(await request.read())
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise bad_request("'input_file_id' must be a file id.", param="input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOW_S:
        raise bad_request("'completion_window' must be \"24h\".", param="completion_window")
    metadata = _metadata(body.get("metadata"))
    files, batches = _stores(request)
    file = await files.get(input_file_id)
    if file is None:
        raise ApiError(404, "No such file.", param="input_file_id", code="file_not_found")
    if file.purpose != UPLOAD_PURPOSE:
        raise bad_request('The input file\'s purpose must be "batch".', param="input_file_id")
    total = await files.count(file.id)
    batch = await batches.create(endpoint, file.id, total, window, metadata)
    return web.json_response(batch.to_json())


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA
        or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY for k in value)
        or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in value.values())
    ):
        raise bad_request(
            f"'metadata' must be an object of at most {MAX_METADATA} string values (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}).",
            param="metadata",
        )
    return value


async def _batch(request: web.Request) -> Batch:
    batch = await _stores(request)[1].get(request.match_info["batch_id"])
    if batch is None:
        raise batch_not_found()
    return batch


async def get_batch(request: web.Request) -> web.Response:
    return web.json_response((await _batch(request)).to_json())


async def list_batches(request: web.Request) -> web.Response:
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT:
        raise bad_request(f"'limit' must be an integer in [1, {LIST_LIMIT}].", param="limit")
    batches, more = await _stores(request)[1].list(int(raw), request.query.get("after"))
    data = [b.to_json() for b in batches]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def cancel_batch(request: web.Request) -> web.Response:
    batch = await _batch(request)
    status = await _stores(request)[1].cancel(batch.id)
    if status not in ("cancelling", "cancelled"):
        raise ApiError(
            409,
            f"A batch in status {status} cannot be cancelled.",
            param="batch_id",
            code="batch_not_cancellable",
        )
    return web.json_response((await _batch(request)).to_json())


def add_routes(app: web.Application) -> None:
    app.router.add_post(UPLOAD_PATH, upload_file)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
