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
            "App", "AsyncResult", "Signature", "State", "Task", "LamportClock", "Publisher", "Settings",
            "TaskMessage", "BrokerBlocked", "BrokerSvcError", "BrokerUnavailable", "ConfigurationError",
            "ContentDisallowed",
            "DecodeError", "InvalidTaskMessage", "MessageError", "MessageTooLarge", "NotRegistered",
            "PublishError", "PublishNacked", "ResultTimeout", "SoftTimeLimitExceeded", "TaskError",
            "TaskRevokedError", "Unroutable",
        ]
    )  # fmt: skip
    for name in broker_svc.__all__:
        assert getattr(broker_svc, name) is not None


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


# DESIGN §1: a module is pure, blocking (pika) or async (aio-pika), never two of those.
# pika: broker_svc's connection modules (the I/O thread, its channel work, its parameters, reading its
# failures) and the control client's.
BLOCKING = {
    "broker_svc/channel.py",
    "broker_svc/connection.py",
    "broker_svc/failures.py",
    "broker_svc/gathering.py",
    "broker_svc/parameters.py",
    "control/client.py",
    "control/connection.py",
    "control/streams.py",
}
ASYNC_IN_CONTROL = {"control/node.py", "control/broadcast.py", "control/declare.py"}
PURE_CONTROL = {"control/protocol.py", "control/commands.py", "control/collect.py", "control/members.py",
                "control/revocations.py", "control/results.py", "control/signing.py"}  # fmt: skip


def test_pika_only_in_blocking_modules_and_aio_pika_only_in_worker_and_async_control_modules():
    for package in ("broker_svc", "control", "worker"):
        for path, names in _package_imports(package).items():
            tops = _top(names)
            if "pika" in tops:
                assert path in BLOCKING, path
            if "aio_pika" in tops or "aiormq" in tops:
                assert path.startswith("worker/") or path in ASYNC_IN_CONTROL, path


def test_pure_control_modules_do_no_io():
    for path in PURE_CONTROL:
        tops = _top(_imports(ROOT / path))
        assert not tops & {"pika", "aio_pika", "aiormq", "socket", "asyncio"}, path


def test_pure_modules_do_no_io():
    pure = [
        "settings",
        "errors",
        "clock",
        "codec",
        "message",
        "topology",
        "states",
        "outcome",
        "task",
        "pending",
        "rates",
        "outbox",
        "amqp_fields",
        "ids",
        "lazy_exports",
    ]
    for module in pure:
        tops = _top(_imports(ROOT / "broker_svc" / f"{module}.py"))
        assert not tops & {"pika", "aio_pika", "aiormq", "socket", "asyncio"}, module


def test_no_unsafe_deserializer_on_any_receive_path():
    banned_calls = {("pickle", "loads"), ("pickle", "load"), ("marshal", "loads"), ("yaml", "load")}
    for package in ("broker_svc", "control", "worker"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func
                    if isinstance(func, ast.Name):
                        assert func.id not in {"eval", "exec"}, f"{path}: {func.id}"
                    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                        assert (func.value.id, func.attr) not in banned_calls, (
                            f"{path}: {func.value.id}.{func.attr}"
                        )
