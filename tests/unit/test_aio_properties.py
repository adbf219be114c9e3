"""The asyncio client's task properties are the blocking client's bytes, as aiormq marshals them."""

from __future__ import annotations

from pamqp import commands, header

from broker_svc.aio.properties import EncodedProperties
from broker_svc.clock import LamportClock
from broker_svc.connection.pending import PendingPublish, prepare_publish
from broker_svc.settings import Settings
from broker_svc.wire.amqp_fields import encode_properties
from broker_svc.wire.task.task_message import TaskMessage


def _pending() -> PendingPublish:
    message = TaskMessage(id="t-1", task="proj.add", args=[1, 2], reply_to="r", correlation_id="t-1")
    return prepare_publish(message, settings=Settings(), clock=LamportClock(), queue="celery")


def test_a_content_header_carries_the_blocking_clients_property_bytes_and_the_task_id():
    pending = _pending()
    properties = EncodedProperties(pending)
    frame = header.ContentHeader(0, len(pending.message.body), properties).marshal()
    expected = encode_properties(**pending.property_fields(), message_id="t-1")
    assert frame.endswith(expected)
    decoded = header.ContentHeader()
    decoded.unmarshal(frame)
    assert isinstance(decoded.properties, commands.Basic.Properties)
    assert decoded.properties.message_id == "t-1"
    assert decoded.properties.headers is not None and decoded.properties.headers["retries"] == 0


def test_small_header_ints_go_out_as_32_bit_ints_as_celery_reads_them():
    # pamqp's own encoder would write retries=0 as a one-byte 'b' (WIRE.md §2.2).
    expected = encode_properties(**_pending().property_fields(), message_id="t-1")
    assert b"\x07retriesI\x00\x00\x00\x00" in expected
