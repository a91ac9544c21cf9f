"""Typed FastAPI dependencies: the engine and the request limits the app was built with."""

from typing import Annotated

from fastapi import Depends, Request

from server.engine.contract import Engine
from server.protocol.limits import RequestLimits


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def get_limits(request: Request) -> RequestLimits:
    limits: RequestLimits = request.app.state.request_limits
    return limits


EngineDep = Annotated[Engine, Depends(get_engine)]
LimitsDep = Annotated[RequestLimits, Depends(get_limits)]
