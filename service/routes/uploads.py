"""Reading an uploaded file (its size is bounded by the body limit, service/limits.py)."""

from __future__ import annotations

from fastapi import UploadFile

from fragsearch.service.errors import ApiError

CHUNK = 1024 * 1024


async def read_upload(file: UploadFile) -> bytes:
    """The upload's bytes (422 when there are none)."""
    parts: list[bytes] = []
    while chunk := await file.read(CHUNK):
        parts.append(chunk)
    if not parts:
        raise ApiError(422, "bad_image", "the upload is empty")
    return b"".join(parts)
