"""A result backend for Celery apps whose chords Clockwork workers join on RabbitMQ alone.

Celery refuses chords on ``rpc://``, and its other backends need a store (Redis, a database) that
counts the header's results. With this backend a Celery client keeps ``rpc://`` results and sends
chords that Clockwork workers join in the broker (worker/single_active/chord_join.py)::

    app = Celery("proj", broker="amqp://...", backend="broker_svc.celery_backend:ChordBackend")
    chord([add.s(2, 2), add.s(4, 4)])(xsum.s()).get()          # 12

It is Celery's rpc backend with three differences:

- ``apply_chord`` sends no ``celery.chord_unlock`` poller: it writes the chord's size into the
  body, which every header task carries (``chord_size``), so the joiner knows when all are in, and
  the body's queue, routed by this app as ``body.delay()`` would be, so the joiner (a worker of
  whichever app) sends it there and never routes it by its own rules.
- ``on_chord_part_return`` (called in a *Celery* worker that runs a header task) leaves the task's
  part in the join queue of the app's namespace (its ``app_namespace`` setting, as a Clockwork
  app's: docs/guide.md, "Many apps on one broker"), as a Clockwork worker does, so a mixed fleet
  joins too.
- ``add_to_chord`` (a header task's ``self.add_to_chord`` on a Celery worker) tells the joiner of
  the added task, as a Clockwork worker does.
- ``ensure_chords_allowed`` allows them.

Importable only where Celery is installed (``pip install 'clockwork-tasks[celery]'``).
"""

from __future__ import annotations

from typing import Any

from celery import states
from celery.backends.rpc import RPCBackend
from kombu.entity import Queue

from broker_svc.topology import app_namespace, chord_join_queue
from broker_svc.wire.records.chord_part import NAMESPACE_KEY, ChordGrowth, growth_map, join_namespace

__all__ = ["ChordBackend"]


class ChordBackend(RPCBackend):  # type: ignore[misc]  # Celery is untyped
    """Celery's ``rpc://`` backend, with chords joined by Clockwork workers in the broker."""

    def get_task_meta(self, task_id: str, backlog_limit: int = 1000) -> Any:
        """What is known of ``task_id``, polling the reply queue only when nothing consumes it.

        Celery's rpc backend polls the reply queue (a declare and a ``basic.get``) for every task it
        is asked about. Waiting on a chord's body, Celery's client asks about every header task not
        yet ended at each event it drains: quadratic round trips (a 300-task header took 40 s of
        polls here, a 1,000-task one minutes). While the result consumer consumes the queue, every
        reply reaches it and lands in the cache (or the out-of-band buffer) as it comes, so the
        cache is the answer and a task not in it is pending.
        """
        cached: Any = self._cache.get(task_id)
        if cached is not None and cached.get("status") in states.READY_STATES:
            return cached
        consuming = getattr(self.result_consumer, "_consumer", None) is not None  # Celery's, started
        if consuming and task_id not in self._out_of_band:
            return cached if cached is not None else {"status": states.PENDING, "result": None}
        return super().get_task_meta(task_id, backlog_limit)

    def ensure_chords_allowed(self) -> None:
        """Chords are allowed: Clockwork workers join them."""

    def apply_chord(self, header_result_args: Any, body: Any, **kwargs: Any) -> None:
        """Carry the chord's size on its body (each header task carries the body); no poller."""
        _group_id, results = header_result_args[0], header_result_args[1]
        body["chord_size"] = len(results)
        body[NAMESPACE_KEY] = self._namespace()  # this app's joiner joins it, whoever runs its header
        options = body.setdefault("options", {})
        if not options.get("queue") and not options.get("exchange"):
            queue = self._body_queue(body, options)
            if queue is not None:
                options["queue"] = queue

    def _namespace(self) -> str:
        return app_namespace(self.app.conf.get("app_namespace"))

    def _body_queue(self, body: Any, options: dict[str, Any]) -> str | None:
        # Celery's order, as the body's own apply_async would send it: the task's declared queue
        # (under its explicit options), else the app's router (task_routes, then the default queue).
        task = self.app.tasks.get(body["task"])
        declared = getattr(task, "queue", None)
        if isinstance(declared, str) and declared:
            return declared
        routed = self.app.amqp.router.route(dict(options), body["task"], body.get("args"), body.get("kwargs"))
        queue = routed.get("queue")
        name = getattr(queue, "name", queue)
        exchange = getattr(getattr(queue, "exchange", None), "name", None)
        if not isinstance(name, str) or exchange not in (None, "", name):
            return None  # through another exchange: the worker says it cannot send it there
        return name

    def add_to_chord(self, group_id: str, result: Any) -> None:
        """A header task on a Celery worker added ``result``'s task to its chord (``self.add_to_chord``):
        tell the joiner before the task is sent, as a Clockwork worker does
        (``wire/records/chord_part.py``)."""
        task = self.app.current_worker_task
        body = getattr(getattr(task, "request", None), "chord", None) or {}
        size = body.get("chord_size")
        if not isinstance(size, int):
            raise NotImplementedError("add_to_chord: this chord was not sent through ChordBackend")
        growth = ChordGrowth(group_id=group_id, size=size, added=(result.id,))
        self._publish_join_record(body, growth_map(growth))

    def _publish_join_record(self, body: Any, record: dict[str, Any]) -> None:
        spec = chord_join_queue(join_namespace(body, self._namespace()))
        queue = Queue(spec.name, durable=True, queue_arguments=spec.arguments)  # type: ignore[no-untyped-call]
        with self.app.producer_or_acquire() as producer:
            producer.publish(
                record, exchange="", routing_key=spec.name, serializer="json", delivery_mode=2,
                declare=[queue], retry=True,
            )  # fmt: skip

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> None:
        """A Celery worker finished a header task: leave its part where Clockwork's joiner reads it."""
        body = request.chord
        if not body or request.group is None or request.group_index is None:
            return
        size = body.get("chord_size")
        if not isinstance(size, int):
            return  # not sent through this backend: nothing here can join it
        final = state if state in (states.SUCCESS, states.REVOKED) else states.FAILURE
        value = self.encode_result(result, final) if final != states.SUCCESS else result
        part = {
            "group_id": request.group,
            "index": request.group_index,
            "size": size,
            "task_id": request.id,
            "state": final,
            "result": value,
            "body": dict(body),
            "reply_to": request.reply_to,
            "root_id": request.root_id,
        }
        self._publish_join_record(body, part)
