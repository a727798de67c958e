"""A finished batch's output and error files: built from its recorded results, then committed.

The lines are written to temporary lists first (with a TTL: a finalizer that dies leaves nothing
for good) and renamed into place by one script that also sets the final status, only if no other
finalizer committed first (gateway.batch.batch_store).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gateway.batch.batch_store import OUTPUT_PREFIX, Batch, BatchStore
from gateway.batch.file_store import FileObject, FileStore, content_bytes, new_file_id
from gateway.batch.input_file import BatchLine

OUTPUT_PURPOSE = "batch_output"


# Characters JSON leaves raw in strings that line splitters (Python's str.splitlines, some JSONL
# readers) take for line ends: escaped, so each result stays one line however it is read.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def result_line(custom_id: str, response: dict[str, Any] | None, error: Any = None) -> str:
    """One line of an output or error file, as OpenAI writes it."""
    line = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id}
    line |= {"response": response, "error": error}
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)


def expired_line(raw: bytes | None) -> str:
    custom_id = BatchLine.decode(raw).custom_id if raw is not None else ""
    error = {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    }
    return result_line(custom_id, None, error)


async def finalize(store: BatchStore, files: FileStore, batch: Batch, final: str) -> bool:
    """Write the files of `batch`, ending as `final`; False if another finalizer committed."""
    results = await store.results(batch.id)
    output: list[str] = []
    errors: list[str] = []
    for index in sorted(results):
        value = results[index]
        (output if value[:1] == OUTPUT_PREFIX.encode() else errors).append(value[1:].decode())
    if final == "expired":  # OpenAI lists the lines never run, in the error file
        inputs = await files.lines(batch.input_file_id)
        for index in range(batch.total):
            if index not in results:
                errors.append(expired_line(inputs[index] if index < len(inputs) else None))
    tmp = "tmp-" + uuid.uuid4().hex  # this attempt's own: racing finalizers never share one
    temps = (store.keys.file_lines(tmp + "-output"), store.keys.file_lines(tmp + "-error"))
    committed = []
    for lines, temp, suffix in ((output, temps[0], "output"), (errors, temps[1], "error")):
        if not lines:
            committed.append(None)
            continue
        await files.write_lines(temp, lines)
        file = FileObject(
            new_file_id(),
            content_bytes(lines),
            int(time.time()),
            f"{batch.id}_{suffix}.jsonl",
            OUTPUT_PURPOSE,
        )
        committed.append((file.id, file.encode()))
    return await store.commit(batch.id, committed[0], committed[1], temps)
