"""A FastAPI app that sends Clockwork tasks from its endpoints: ``uvicorn examples.fastapi_app:api``.

Start a worker for the tasks first (``python -m worker -A examples.tasks:app``). One ``AsyncApp``
is opened for the life of the server (FastAPI's lifespan) and shared by every request: its sends
share one channel, and each request awaits only its own confirm and its own result.

    GET  /add?x=2&y=3          waits for the task's result: {"task_id": ..., "result": 5}
    POST /words  {"text": ...} fire and forget: 202 {"task_id": ...} once the broker has the task
    GET  /result/{task_id}     the state of a task this server sent
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

from broker_svc.aio import AsyncApp
from broker_svc.errors import BrokerSvcError, ResultTimeout, TaskError
from examples.tasks import add, app, word_count


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    async with AsyncApp(app) as clockwork:
        api.state.clockwork = clockwork
        yield


api = FastAPI(title="Clockwork from FastAPI", lifespan=lifespan)


def clockwork_of(request: Request) -> AsyncApp:
    client: AsyncApp = request.app.state.clockwork
    return client


class Text(BaseModel):
    text: str


@api.get("/add")
async def add_numbers(x: int, y: int, request: Request) -> dict[str, Any]:
    """Send ``add`` and wait (without blocking the server) for its result, pushed by the worker."""
    result = await clockwork_of(request).delay(add, x, y)
    try:
        total = await result.get(timeout=10)
    except ResultTimeout:
        raise HTTPException(status_code=504, detail=f"task {result.id} did not finish in 10 s") from None
    except TaskError as exc:
        raise HTTPException(status_code=500, detail=f"task {result.id} failed: {exc}") from None
    return {"task_id": result.id, "result": total}


@api.post("/words", status_code=202)
async def count_words(body: Text, request: Request) -> dict[str, str]:
    """Fire and forget: answer as soon as the broker confirmed the task."""
    try:
        result = await clockwork_of(request).delay(word_count, body.text)
    except BrokerSvcError as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from None
    return {"task_id": result.id}


@api.get("/result/{task_id}")
async def task_state(task_id: str, request: Request) -> dict[str, Any]:
    """The state of a task this server sent (its result came to this server's reply queue)."""
    result = clockwork_of(request).AsyncResult(task_id)
    return {"task_id": task_id, "state": result.state}
