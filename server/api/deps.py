"""Typed FastAPI dependencies: the engine the app was built with."""

from typing import Annotated

from fastapi import Depends, Request

from server.engine.contract import Engine


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(get_engine)]
