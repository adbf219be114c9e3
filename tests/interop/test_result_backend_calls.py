"""``app.backend`` and ``GroupResult.save``/``restore`` on Redis results, beside a Celery client's.

A group saved by one side is restored by the other (Celery's ``celery-taskset-meta-<id>``), and a
state stored for any task id (Celery's ``backend.store_result``) is read by either client. On
``rpc://`` results there is nowhere to keep them, and the calls say so. Without an app, the calls
read the current app's backend, as Celery's do.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.result import AsyncResult as CeleryAsyncResult
from celery.result import GroupResult as CeleryGroupResult

from broker_svc import App, AsyncResult, GroupResult, Settings
from broker_svc.apps import open_apps
from broker_svc.errors import TaskError
from tests.interop.conftest import close_celery_client

pytestmark = pytest.mark.interop


@pytest.fixture
def ours(redis_url: str) -> Iterator[App]:
    app = App("backend-calls", settings=Settings(), backend=redis_url, set_as_current=False)
    yield app
    app.close()


@pytest.fixture
def theirs(redis_url: str) -> Iterator[Celery]:
    app = Celery("backend-calls", broker="memory://", backend=redis_url)
    app.conf.update(accept_content=["json"], result_accept_content=["json"])
    yield app
    close_celery_client(app)


def ids(result: object) -> object:
    """A result's ids as nested lists (a group's members in order)."""
    members = getattr(result, "results", None)
    if members is None:
        return str(getattr(result, "id"))  # noqa: B009  # a handle of either client
    return [str(getattr(result, "id")), [ids(m) for m in members]]  # noqa: B009


def test_a_group_saved_by_our_client_is_restored_by_celerys_and_back(ours: App, theirs: Celery):
    nested = GroupResult("g-inner", [ours.AsyncResult("t-2"), ours.AsyncResult("t-3")], app=ours)
    saved = GroupResult("g-ours", [ours.AsyncResult("t-1"), nested], app=ours).save()
    restored = CeleryGroupResult.restore("g-ours", app=theirs)
    assert ids(restored) == ids(saved) == ["g-ours", ["t-1", ["g-inner", ["t-2", "t-3"]]]]

    CeleryGroupResult("g-theirs", [CeleryAsyncResult("c-1", app=theirs)], app=theirs).save()
    back = GroupResult.restore("g-theirs", app=ours)
    assert back is not None and ids(back) == ["g-theirs", ["c-1"]]
    back.delete()
    assert GroupResult.restore("g-theirs", app=ours) is None
    assert ours.backend.restore_group("never-saved") is None


def test_restore_and_a_result_without_an_app_read_the_current_apps_backend(
    theirs: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(open_apps, "_current", open_apps._current)  # put back afterwards
    current = App("backend-current", settings=Settings(), backend=redis_url)  # the current app
    try:
        CeleryGroupResult("g-current", [CeleryAsyncResult("c-9", app=theirs)], app=theirs).save()
        theirs.backend.store_result("c-9", {"total": 9}, "SUCCESS")
        restored = GroupResult.restore("g-current")  # as Celery's: current_app's backend
        assert restored is not None and ids(restored) == ["g-current", ["c-9"]]
        assert restored.get(timeout=10) == [{"total": 9}]
        assert AsyncResult("c-9").get(timeout=10) == {"total": 9}
        GroupResult("g-current", restored.results).delete()  # no app: the current one's too
        assert GroupResult.restore("g-current") is None
    finally:
        current.close()


def test_a_state_stored_for_any_task_id_is_read_by_both_clients(ours: App, theirs: Celery, redis_url: str):
    # Read by Celery's backend as its client's get() reads a stored state (without its pubsub).
    ours.backend.store_result("elsewhere-1", {"total": 42}, "SUCCESS")
    meta = theirs.backend.get_task_meta("elsewhere-1")
    assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", {"total": 42}, "elsewhere-1")
    ours.backend.store_result("elsewhere-2", KeyError("missing"), "FAILURE")
    failed = theirs.backend.get_task_meta("elsewhere-2")
    assert failed["status"] == "FAILURE"
    assert isinstance(failed["result"], KeyError) and failed["result"].args == ("missing",)
    theirs.backend.store_result("elsewhere-3", [1, 2], "SUCCESS")
    reader = App("backend-reader", settings=Settings(), backend=redis_url, set_as_current=False)
    try:
        assert reader.AsyncResult("elsewhere-1").get(timeout=10) == {"total": 42}
        assert reader.AsyncResult("elsewhere-3").get(timeout=10) == [1, 2]
        with pytest.raises(TaskError, match="missing"):
            reader.AsyncResult("elsewhere-2").get(timeout=10)
    finally:
        reader.close()


def test_on_rpc_results_the_backend_calls_say_there_is_nowhere_to_keep_them():
    app = App("rpc-backend-calls", settings=Settings(), set_as_current=False)
    try:
        with pytest.raises(NotImplementedError, match="rpc://"):
            GroupResult("g", [app.AsyncResult("t")], app=app).save()
        with pytest.raises(NotImplementedError, match="rpc://"):
            GroupResult.restore("g", app=app)
        with pytest.raises(NotImplementedError, match="rpc://"):
            app.backend.store_result("t", 1, "SUCCESS")
    finally:
        app.close()
