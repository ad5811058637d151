"""GET /images/{id}, GET /images/{id}/thumbnail, POST /images, DELETE /images/{id}."""

from __future__ import annotations

import mimetypes
import re
import time
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Query, Response, UploadFile
from fastapi.responses import FileResponse
from pydantic import BeforeValidator
from starlette.concurrency import run_in_threadpool

from fragsearch.index.duplicates import THRESHOLD
from fragsearch.index.ids import MAX_ID
from fragsearch.service.deps import EngineDep, GatesDep, require_key
from fragsearch.service.errors import ApiError, responses
from fragsearch.service.routes.convert import image_out, image_url, thumbnail_url
from fragsearch.service.routes.uploads import read_upload
from fragsearch.service.schemas import DuplicateOut, DuplicatesResponse, ImageOut
from fragsearch.service.thumbnails import SIZES, browser_readable, snap

ID_TEXT = re.compile(r"0|[1-9][0-9]{0,18}")  # plain decimal, no sign, blank, point or leading zero


def _id_text(value: object) -> object:
    """Only plain decimal text is an id; anything else, of any length, fails validation before int()
    sees it (the path's 404). The ':int' path converter called int() on any run of digits and failed
    with a 500 past Python's 4,300-digit limit."""
    if isinstance(value, str) and not ID_TEXT.fullmatch(value):
        raise ValueError("an image id is a decimal number")
    return value


ImageId = Annotated[int, Path(ge=0, le=MAX_ID, description="image id in the index"), BeforeValidator(_id_text)]


# OpenAPI links: the id an upload answers with is the id GET and DELETE take (stateful fuzzing follows them)
ADDED_LINKS = {
    "GetImage": {"operationId": "get_image", "parameters": {"image_id": "$response.body#/id"},
                 "description": "the file of the image just added"},
    "GetThumbnail": {"operationId": "get_thumbnail", "parameters": {"image_id": "$response.body#/id"},
                     "description": "a thumbnail of the image just added"},
    "DeleteImage": {"operationId": "delete_image", "parameters": {"image_id": "$response.body#/id"},
                    "description": "remove the image just added"},
}


def _not_found(image_id: int) -> ApiError:
    return ApiError(404, "not_found", f"no image with id {image_id}")


router = APIRouter(tags=["images"])


@router.get("/images/{image_id}", operation_id="get_image", response_class=FileResponse, responses={
    200: {"content": {"image/*": {}}, "description": "the image file (a JPEG rendition of HEIC, AVIF, TIFF)"},
    **responses(404, 422, 503, 504)})
async def get_image(image_id: ImageId, engine: EngineDep, gates: GatesDep,
                    original: Annotated[bool, Query(description=(
                        "the file as it is stored even where browsers cannot show it (HEIC, AVIF, TIFF); "
                        "by default those are served as a full-size JPEG rendition"))] = False,
                    ) -> FileResponse:
    """The file of an indexed image (only files the index holds are served); a HEIC, AVIF or TIFF
    original as a JPEG of the same size unless `original` is set."""
    path = await run_in_threadpool(engine.image_file, image_id)
    if path is None:
        raise _not_found(image_id)
    if not original and not browser_readable(path):
        rendition = await gates.search.run(engine.thumbnail_file, image_id, None)
        if rendition is None:
            raise _not_found(image_id)
        return FileResponse(rendition, media_type="image/jpeg", headers={"Cache-Control": "public, max-age=3600"})
    media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return FileResponse(path, media_type=media, headers={"Cache-Control": "public, max-age=3600"})


@router.get("/images/{image_id}/thumbnail", operation_id="get_thumbnail", response_class=FileResponse,
            responses={200: {"content": {"image/jpeg": {}}, "description": "the thumbnail (JPEG)"},
                       **responses(404, 422, 503, 504)})
async def get_thumbnail(image_id: ImageId, engine: EngineDep, gates: GatesDep,
                        size: Annotated[int, Query(ge=1, le=4096, description=(
                            "longest side wanted, in pixels; served at the next of "
                            f"{', '.join(map(str, SIZES))} (the largest above it); never enlarged"))] = 256,
                        ) -> FileResponse:
    """A JPEG thumbnail of an indexed image, made once and cached; the boxes of the results are in
    the original's pixels, so draw them in proportion to the original's width and height."""
    path = await gates.search.run(engine.thumbnail_file, image_id, snap(size))
    if path is None:
        raise _not_found(image_id)
    return FileResponse(path, media_type="image/jpeg", headers={"Cache-Control": "public, max-age=3600"})


@router.get("/images/{image_id}/duplicates", operation_id="get_duplicates", response_model=DuplicatesResponse,
            responses=responses(404, 422, 503, 504))
async def get_duplicates(image_id: ImageId, engine: EngineDep, gates: GatesDep,
                         threshold: Annotated[float, Query(ge=0.5, le=1.0, description=(
                             "cosine of the whole-frame fragments at or above which an image is a near-"
                             f"duplicate; default {THRESHOLD}, measured on altered copies of Flickr8K dev "
                             "photos (docs/results/duplicates-dev.csv)"))] = THRESHOLD,
                         ) -> DuplicatesResponse:
    """Near-duplicates of an indexed image: the same photo resized, re-encoded or cropped a little."""
    t0 = time.perf_counter()
    found = await gates.search.run(engine.duplicates, image_id, threshold)
    if found is None:
        raise _not_found(image_id)
    return DuplicatesResponse(image_id=image_id, threshold=threshold, duplicates=[
        DuplicateOut(id=d.image_id, name=d.name, url=image_url(d.image_id), thumbnail=thumbnail_url(d.image_id),
                     similarity=round(d.similarity, 4)) for d in found],
        took_ms=round((time.perf_counter() - t0) * 1000, 2))


@router.post("/images", operation_id="add_image", status_code=201, response_model=ImageOut,
             dependencies=[Depends(require_key)],
             responses={201: {"links": ADDED_LINKS}, **responses(401, 403, 408, 413, 415, 422, 503, 504, 507)})
async def add_image(file: Annotated[UploadFile, File(description="an image (JPEG, PNG, ...)")],
                    engine: EngineDep, gates: GatesDep) -> ImageOut:
    """Index an uploaded image (needs the API key); it is stored in the service's uploads folder."""
    data = await read_upload(file)
    rec = await gates.heavy.run(engine.add_image, data, file.filename)
    return image_out(rec)


@router.delete("/images/{image_id}", operation_id="delete_image", status_code=204,
               dependencies=[Depends(require_key)],
               responses=responses(401, 403, 404, 503, 507))
async def delete_image(image_id: ImageId, engine: EngineDep) -> Response:
    """Remove an image from the index (needs the API key)."""
    if not await run_in_threadpool(engine.remove_image, image_id):
        raise _not_found(image_id)
    return Response(status_code=204)
