"""GET /images/{id}, POST /images, DELETE /images/{id}."""

from __future__ import annotations

import mimetypes
from typing import Annotated

from fastapi import APIRouter, Depends, File, Path, Response, UploadFile
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from service.deps import EngineDep, SettingsDep, require_key
from service.errors import ApiError, responses
from service.routes.convert import image_out
from service.routes.uploads import read_upload
from service.schemas import ImageOut

ImageId = Annotated[int, Path(description="image id in the index")]


def _not_found(image_id: int) -> ApiError:
    return ApiError(404, "not_found", f"no image with id {image_id}")


def build_router() -> APIRouter:
    router = APIRouter(tags=["images"])

    @router.get("/images/{image_id:int}", response_class=FileResponse, responses={
        200: {"content": {"image/*": {}}, "description": "the image file"},
        **responses(404, 503)})
    async def get_image(image_id: ImageId, engine: EngineDep) -> FileResponse:
        """The file of an indexed image (only files the index holds are served)."""
        path = await run_in_threadpool(engine.image_file, image_id)
        if path is None:
            raise _not_found(image_id)
        media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FileResponse(path, media_type=media, headers={"Cache-Control": "public, max-age=3600"})

    @router.post("/images", status_code=201, response_model=ImageOut, dependencies=[Depends(require_key)],
                 responses=responses(401, 403, 413, 415, 422, 503))
    async def add_image(file: Annotated[UploadFile, File(description="an image (JPEG, PNG, ...)")],
                        engine: EngineDep, s: SettingsDep) -> ImageOut:
        """Index an uploaded image (needs the API key); it is stored in the service's uploads folder."""
        data = await read_upload(file, s.max_upload_bytes)
        rec = await run_in_threadpool(engine.add_image, data, file.filename)
        return image_out(rec)

    @router.delete("/images/{image_id:int}", status_code=204, dependencies=[Depends(require_key)],
                   responses=responses(401, 403, 404, 503))
    async def delete_image(image_id: ImageId, engine: EngineDep) -> Response:
        """Remove an image from the index (needs the API key)."""
        if not await run_in_threadpool(engine.remove_image, image_id):
            raise _not_found(image_id)
        return Response(status_code=204)

    return router
