"""A keyed task that reached its queue without passing its gate: sent to the gate first.

A Celery client (or any sender that does not know a task's ``dedup_key``) publishes straight to the
task's queue. The worker forms the key from the call's arguments, as a Clockwork client would, and
hands the task to its gate shard instead of running it, marked as forwarded: a caller that does
not know ``DECLINED`` is then answered ``REVOKED`` when it is declined (``gate_shard.py``). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

from broker_svc.sending.dedup_keys import dedup_call
from broker_svc.tasks.task import Task
from broker_svc.topology import dedup_gate_queue
from broker_svc.wire.records.dedup import FORWARDED_HEADER, KEY_HEADER, dedup_headers, shard_of
from broker_svc.wire.task.task_message import TaskMessage
from worker.rules.disposition import Disposition

__all__ = ["to_gate"]

log = structlog.get_logger(__name__)


def to_gate(
    task: Task, request: TaskMessage, headers: Mapping[str, Any], queue: str, namespace: str
) -> Disposition | None:
    """The copy to the task's gate shard, if ``task`` has a key of its own and this delivery did not
    come through the gate (the app ``namespace``'s); None: it runs as it is."""
    spec = task._dedup
    if spec is None or KEY_HEADER in headers:
        return None
    try:
        call = dedup_call(request.task, {}, spec, request.args, request.kwargs)
    except (TypeError, ValueError) as exc:  # arguments that give no key: the run will say why
        log.warning("dedup_key_not_formed", error=str(exc))
        return None
    if call is None:
        return None
    log.info("dedup_forwarded_to_gate", key=call.key)
    gate = dedup_gate_queue(shard_of(call.key), namespace)
    return Disposition.republish(
        {**dedup_headers(call.key, call.timeout_s, queue), FORWARDED_HEADER: True}, to=gate
    )
