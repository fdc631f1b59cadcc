"""``GET /whoami``: the owner and scope of the calling token, so that a client can tell which team's
jobs are its own (``chimes apply`` manages exactly those, even with an admin token that sees more)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from chimes.api.auth import current_principal
from chimes.api.responses import JSONResponse
from chimes.store.tokens import Principal

router = APIRouter(tags=["tokens"])


@router.get("/whoami", response_class=JSONResponse)
async def whoami(caller: Annotated[Principal, Depends(current_principal)]) -> JSONResponse:
    return JSONResponse({"owner": caller.owner, "scope": caller.scope, "admin": caller.admin})
