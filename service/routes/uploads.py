"""Reading an uploaded file under a size limit."""

from __future__ import annotations

from fastapi import UploadFile

from service.errors import ApiError

CHUNK = 1024 * 1024


async def read_upload(file: UploadFile, limit: int) -> bytes:
    """The upload's bytes; 413 as soon as more than `limit` bytes are seen (the request body itself
    is already capped by the route's body limit, so an oversized stream is never read whole)."""
    if file.size is not None and file.size > limit:
        raise ApiError(413, "upload_too_large", f"the upload is larger than {limit} bytes")
    parts: list[bytes] = []
    total = 0
    while chunk := await file.read(CHUNK):
        total += len(chunk)
        if total > limit:
            raise ApiError(413, "upload_too_large", f"the upload is larger than {limit} bytes")
        parts.append(chunk)
    if total == 0:
        raise ApiError(422, "bad_image", "the upload is empty")
    return b"".join(parts)
