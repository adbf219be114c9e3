"""Where a worker sends a chain's next step, a callback or a chord body: where delay() would."""

from __future__ import annotations

from broker_svc import App, Settings
from broker_svc.canvas.follow_ups import FollowUp
from broker_svc.wire.task.task_message import TaskMessage
from worker.rules.canvas_plan import follow_up_queue


def _follow_up(task: str, queue: str | None = None) -> FollowUp:
    return FollowUp(TaskMessage(id="t-1", task=task, args=[], kwargs={}), queue)


def test_a_follow_up_goes_where_delay_would_send_it():
    app = App("routing", settings=Settings(default_queue="fallback"))
    app.conf.task_routes = {"t.declared": {"queue": "routed"}, "t.routed": {"queue": "routed"}}

    @app.task(name="t.declared", queue="declared")
    def declared() -> None: ...

    @app.task(name="t.routed")
    def routed() -> None: ...

    try:
        assert follow_up_queue(app, _follow_up("t.declared", queue="explicit")) == "explicit"
        assert follow_up_queue(app, _follow_up("t.declared")) == "declared"  # over the route, as delay()
        assert follow_up_queue(app, _follow_up("t.routed")) == "routed"
        assert follow_up_queue(app, _follow_up("t.unknown.here")) == "fallback"
    finally:
        app.close()
