"""Pins the public API and the import rules (STYLE rules 5, 6 and 9)."""

from __future__ import annotations

import ast
import pathlib

import broker_svc
import worker

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_broker_svc_exports_exactly_its_public_names():
    assert sorted(broker_svc.__all__) == sorted(
        [
            "App", "AsyncResult", "Signature", "State", "Task", "current_app", "shared_task", "LamportClock",
            "Job", "JobState",
            "GroupResult", "ResultSet", "chain", "chord", "chunks", "group", "signature", "xmap", "xstarmap",
            "StampingVisitor",
            "Publisher", "Settings",
            "TaskMessage", "BrokerBlocked", "BrokerSvcError", "BrokerUnavailable", "ChordError",
            "ConfigurationError",
            "ContentDisallowed", "Ignore", "Reject",
            "DecodeError", "InvalidTaskMessage", "MaxRetriesExceededError", "MessageError",
            "MessageTooLarge", "NotRegistered", "PublishError", "PublishNacked", "ResultTimeout", "Retry",
            "SoftTimeLimitExceeded", "SpoolError", "SpoolFull", "TaskDeclined", "TaskError",
            "TaskRevokedError", "TimeLimitExceeded", "Unroutable",
        ]
    )  # fmt: skip
    for name in broker_svc.__all__:
        assert getattr(broker_svc, name) is not None


def test_the_asyncio_client_exports_exactly_its_public_names():
    import broker_svc.aio
    import control.aio.client

    assert sorted(broker_svc.aio.__all__) == ["AioGroupResult", "AioResult", "AsyncApp"]
    for name in broker_svc.aio.__all__:
        assert getattr(broker_svc.aio, name) is not None
    assert control.aio.client.__all__ == ["AsyncControl"]


def test_worker_exports():
    assert sorted(worker.__all__) == ["WorkerConfig", "WorkerService"]


def _imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _package_imports(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): _imports(p) for p in (ROOT / package).rglob("*.py")}


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_imports_flow_worker_to_control_to_broker_svc_only():
    for path, names in _package_imports("broker_svc").items():
        assert not _top(names) & {"control", "worker"}, path
    for path, names in _package_imports("control").items():
        assert "worker" not in _top(names), path


# DESIGN §1: a module is pure, blocking (pika) or async (aio-pika), never two of those. The folder says
# which: these rules name folders, never files, so a new module is checked by where it is put. A
# blocking folder inside an async one (the scheduler service in worker/beat/) is blocking: the more
# specific folder wins.
BLOCKING_FOLDERS = ("broker_svc/connection/", "control/blocking/", "worker/beat/")
ASYNC_FOLDERS = ("worker/", "control/aio/", "broker_svc/aio/")
PURE_FOLDERS = ("broker_svc/wire/", "control/protocol/", "broker_svc/schedules/")
IO_LIBRARIES = {"pika", "aio_pika", "aiormq", "pamqp", "socket", "asyncio", "selectors", "redis"}
ASYNC_LIBRARIES = {"aio_pika", "aiormq", "pamqp", "asyncio"}


def test_pika_only_in_blocking_folders_and_aio_pika_only_in_async_folders():
    for package in ("broker_svc", "control", "worker"):
        for path, names in _package_imports(package).items():
            tops = _top(names)
            if "pika" in tops:
                assert path.startswith(BLOCKING_FOLDERS), path
            if tops & {"aio_pika", "aiormq", "pamqp"}:
                assert path.startswith(ASYNC_FOLDERS), path
                assert not path.startswith(BLOCKING_FOLDERS + LEADER_FOLDERS), path


def test_blocking_folders_inside_the_worker_run_on_threads_not_on_an_event_loop():
    checked = 0
    for path, names in _package_imports("worker").items():
        if path.startswith(BLOCKING_FOLDERS + LEADER_FOLDERS):
            assert not _top(names) & ASYNC_LIBRARIES, path
            checked += 1
    assert checked >= 8  # worker/beat/ and worker/leader/ exist and hold the scheduler and election


def test_pure_folders_do_no_io():
    checked = 0
    for package in ("broker_svc", "control"):
        for path, names in _package_imports(package).items():
            if path.startswith(PURE_FOLDERS):
                assert not _top(names) & IO_LIBRARIES, path
                checked += 1
    assert checked >= 10  # the folders exist and hold the wire and protocol modules


def test_redis_is_imported_only_by_the_redis_results_folder_which_imports_no_amqp_library():
    # The Redis result backend is optional (clockwork-tasks[redis]): everything else reaches it lazily,
    # through broker_svc/redis_results/, so an app on rpc:// never imports redis-py.
    checked = 0
    for package in ("broker_svc", "control", "worker"):
        for path, names in _package_imports(package).items():
            tops = _top(names)
            if path.startswith("broker_svc/redis_results/"):
                assert not tops & (ASYNC_LIBRARIES | {"pika"}), path
                checked += 1
            else:
                assert "redis" not in tops, path
    assert checked >= 5


def test_the_client_nouns_import_no_amqp_library_directly():
    # broker_svc's top level reaches pika only through connection/, loaded when the app first
    # publishes, and aio-pika only through aio/ (the asyncio client).
    for path in (ROOT / "broker_svc").glob("*.py"):
        tops = _top(_imports(path))
        assert not tops & {"pika", "aio_pika", "aiormq", "pamqp", "socket"}, path


def test_app_control_is_typed_by_a_protocol_that_control_api_satisfies():
    # mypy checks the assignment (the signatures); this checks every Protocol member exists.
    from broker_svc.apps.control_plane import ControlPlane, Inspector
    from control.api import Control, Inspect

    control: ControlPlane = Control(settings=broker_svc.Settings())
    inspector: Inspector = control.inspect()
    members = {name for name in vars(ControlPlane) if not name.startswith("_")} | {"close"}
    assert all(callable(getattr(control, name)) for name in members)
    assert isinstance(inspector, Inspect)
    assert all(callable(getattr(inspector, n)) for n in vars(Inspector) if not n.startswith("_"))
    app = broker_svc.App("typed", settings=broker_svc.Settings())
    try:
        assert isinstance(app.control, Control)  # from the entry point, typed ControlPlane for mypy
        assert callable(app.control.inspect(timeout=0.1).ping)
    finally:
        app.close()


def test_worker_leader_exports_exactly_the_election_its_hooks_and_its_error():
    import worker.leader

    assert sorted(worker.leader.__all__) == ["Election", "LeaderHooks", "LeadershipLost", "Term"]
    for name in worker.leader.__all__:
        assert getattr(worker.leader, name) is not None


def test_broker_svc_schedules_exports_exactly_the_schedules_entries_and_firing():
    import broker_svc.schedules

    assert sorted(broker_svc.schedules.__all__) == sorted(
        [
            "Crontab", "Cronspec", "Every", "Schedule", "crontab", "schedule_from_json",
            "CatchUp", "DEFAULT_CATCH_UP_WINDOW_S", "Entry", "Overlap", "parse_beat_schedule",
            "FIRE_ID_NAMESPACE", "MAX_CATCH_UP", "due_times", "fire_id", "next_due",
        ]
    )  # fmt: skip
    for name in broker_svc.schedules.__all__:
        assert getattr(broker_svc.schedules, name) is not None


# worker/leader/ is blocking (threads) but opens no socket of its own: its one connection is
# broker_svc/amqp/lease_connection.py, a FrameSocket (no pika), so the folder imports no
# AMQP library, no socket and no asyncio; an embedding worker runs it on threads.
LEADER_FOLDERS = ("worker/leader/",)


def test_the_leader_folder_reaches_the_broker_only_through_its_lease_connection():
    checked = 0
    for path, names in _package_imports("worker").items():
        if path.startswith(LEADER_FOLDERS):
            assert not _top(names) & IO_LIBRARIES, path
            checked += 1
    assert checked >= 3


# broker_svc/amqp/ is our own AMQP 0-9-1 client: blocking, on sockets of its own, and no AMQP library
# (a pool child that imports it loads neither pika nor aio-pika), nor asyncio.
OWN_CLIENT_FOLDERS = ("broker_svc/amqp/",)


def test_our_own_amqp_client_uses_no_amqp_library_and_no_event_loop():
    checked = 0
    for path, names in _package_imports("broker_svc").items():
        if path.startswith(OWN_CLIENT_FOLDERS):
            assert not _top(names) & (ASYNC_LIBRARIES | {"pika"}), path
            checked += 1
    assert checked >= 9  # frames, methods, the socket, the feed, shared feed and lease connections, ...


def test_ordered_queues_are_public_in_topology_and_settings():
    import dataclasses

    from broker_svc import Settings, topology

    assert {"ordered_queue", "SINGLE_ACTIVE_ARGUMENT"} <= set(topology.__all__)
    assert "ordered_queues" in {f.name for f in dataclasses.fields(Settings)}
    assert callable(Settings.task_queue)
