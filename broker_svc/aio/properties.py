"""A task's AMQP properties for aiormq, encoded by ``amqp_fields`` as the blocking client encodes them.

aiormq marshals a content header with ``Properties.marshal()`` (pamqp's public method). pamqp's own
encoder writes small header ints as ``b``/``s``/``u`` fields, which py-amqp before 5.4.2 misreads
(WIRE.md §2.2); the blocking client writes ``I`` or ``l``, as Celery does. Giving aiormq these
properties puts the blocking client's very bytes on the wire, with no process-wide patch of pamqp.
"""

from __future__ import annotations

from typing import Any

from pamqp import commands

from broker_svc.connection.pending import PendingPublish
from broker_svc.wire.amqp_fields import encode_properties

__all__ = ["EncodedProperties"]


class EncodedProperties(commands.Basic.Properties):
    """The properties of one send (``PendingPublish.property_fields``), encoded by ``amqp_fields``.

    ``message_id`` is the task id: aiormq matches a ``basic.return`` to its publish by it (and
    would set a random one if it were empty). Encoded at once, so a header AMQP cannot carry
    raises here, before anything is sent.

    Raises:
        TypeError, ValueError: a header or property AMQP cannot carry (``amqp_fields``).
    """

    __slots__ = ("_encoded",)

    def __init__(self, pending: PendingPublish) -> None:
        super().__init__()
        fields: dict[str, Any] = pending.property_fields()
        self.message_id = pending.message.correlation_id or pending.message.headers.get("id")
        self._encoded = encode_properties(**fields, message_id=self.message_id)

    def marshal(self) -> bytes:
        return self._encoded
