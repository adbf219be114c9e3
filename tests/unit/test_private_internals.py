"""Pins on every private pika, pamqp, aio-pika and multiprocessing name we use: each fails when one goes.

The names live in one module per library: ``broker_svc/connection/pika_internals.py`` (pika),
``control/aio/header_ints.py`` (pamqp) and ``worker/amqp/connection.py`` (aio-pika's robust
connection hooks). aiormq is used through its public names only. The dependency ranges in
``pyproject.toml`` are the versions these pins ran against.
"""

from __future__ import annotations

import inspect
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker
from typing import Any

import aio_pika.connection
import aio_pika.robust_connection
import pamqp.encode
import pika
import pika.adapters.base_connection
import pika.adapters.select_connection
import pika.adapters.utils.io_services_utils as io_services
import pika.connection
import pika.frame
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from broker_svc.connection.pika_internals import EncodedProperties, GatheringConnection
from broker_svc.wire.amqp_fields import encode_properties
from control.aio import header_ints
from worker.amqp.connection import FailoverConnection

_MISSING = object()


@dataclass(frozen=True)
class Pin:
    """A private name on ``owner``: it exists, takes ``params`` (if given), and ``read_by`` call it.

    ``attribute`` names an instance attribute: then ``owner.__init__`` must assign it.
    """

    owner: type | object
    name: str
    params: tuple[str, ...] | None = None
    read_by: tuple[Callable[..., Any], ...] = ()
    attribute: bool = False

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__name__', self.owner)}.{self.name}"

    def problem(self) -> str | None:
        """What no longer holds, or None."""
        if self.attribute:
            init = getattr(self.owner, "__init__", None)
            if init is None or not re.search(rf"self\.{self.name}\b[^=\n]*=", inspect.getsource(init)):
                return f"{self.label} is no longer set in __init__"
        else:
            member = inspect.getattr_static(self.owner, self.name, _MISSING)
            if member is _MISSING:
                return f"{self.label} is gone"
            if self.params is not None:
                found = tuple(inspect.signature(member).parameters)
                if found != self.params:
                    return f"{self.label} takes {found}, expected {self.params}"
        for reader in self.read_by:
            if self.name not in inspect.getsource(reader):
                return f"{reader.__qualname__} no longer uses {self.label}"
        return None


_Connection = pika.connection.Connection
_AioConnection = aio_pika.connection.Connection

PINS = [
    # pika: GatheringConnection overrides the frame output and writes through the adapter.
    Pin(
        _Connection,
        "_output_marshaled_frames",
        ("self", "marshaled_frames"),
        read_by=(_Connection._send_message, _Connection._send_frame),
    ),
    Pin(_Connection, "_adapter_emit_data", ("self", "data")),
    # pika: GatheringConnection._emit writes to a plaintext transport's socket when nothing is buffered.
    Pin(pika.adapters.base_connection.BaseConnection, "_transport", attribute=True),
    Pin(io_services, "_AsyncPlaintextTransport"),
    Pin(
        io_services._AsyncTransportBase,
        "_sock",
        attribute=True,
        read_by=(io_services._AsyncTransportBase._produce,),
    ),
    Pin(io_services._AsyncTransportBase, "_state", attribute=True),
    Pin(io_services._AsyncTransportBase, "_STATE_ACTIVE"),
    # pika: release_while_polling swaps the poll object the loop's poller waits on.
    Pin(pika.adapters.select_connection.IOLoop, "_poller", attribute=True),
    Pin(pika.adapters.select_connection.PollPoller, "_create_poller", ()),
    Pin(
        pika.adapters.select_connection.PollPoller,
        "_poll",
        attribute=True,
        read_by=(pika.adapters.select_connection.PollPoller.poll,),
    ),
    # pika: abort_connection.
    Pin(_Connection, "_adapter_disconnect_stream", ("self",)),
    # pika: underlying_channel (control/blocking/members_feed.py closes it directly).
    Pin(BlockingChannel, "_impl", attribute=True, read_by=(BlockingChannel.close,)),
    # pika: EncodedProperties stands in for the properties the content header marshals.
    Pin(pika.frame.Header, "marshal", ("self",)),
    Pin(pika.BasicProperties, "INDEX"),
    # pamqp: header_ints swaps the module global every table int goes through.
    Pin(pamqp.encode, "table_integer", ("value",), read_by=(pamqp.encode.encode_table_value,)),
    # aio-pika: FailoverConnection overrides the robust connection's hooks and reads its state.
    Pin(aio_pika.RobustConnection, "_on_connected", ("self",), read_by=(_AioConnection.connect,)),
    Pin(
        aio_pika.RobustConnection,
        "_on_connection_close",
        ("self", "closing"),
        read_by=(_AioConnection.connect,),
    ),
    Pin(_AioConnection, "_close_called", attribute=True),
    Pin(aio_pika.robust_connection.RobustConnection, "connection_attempt", attribute=True),
    # worker/pool/spawn.py: go_without_resource_tracker sets the fd the tracker and forkserver read.
    Pin(
        resource_tracker.ResourceTracker,
        "_fd",
        attribute=True,
        read_by=(resource_tracker.ResourceTracker.ensure_running, forkserver.main),  # the child takes it
    ),
    Pin(resource_tracker, "_resource_tracker"),
]


@pytest.mark.parametrize("pin", PINS, ids=lambda pin: pin.label)
def test_each_private_name_still_has_its_shape(pin: Pin) -> None:
    assert pin.problem() is None


class _Library:
    def __init__(self) -> None:
        self.kept = 1

    def _send(self, data: bytes) -> None:
        pass

    def write(self, data: bytes) -> None:
        self._send(data)


@pytest.mark.parametrize(
    ("pin", "expected"),
    [
        (Pin(_Library, "_sent"), "_Library._sent is gone"),
        (Pin(_Library, "_send", ("self", "payload")), "takes ('self', 'data'), expected"),
        (Pin(_Library, "_send", read_by=(_Library.__init__,)), "_Library.__init__ no longer uses"),
        (Pin(_Library, "dropped", attribute=True), "no longer set in __init__"),
    ],
)
def test_a_pin_reports_a_renamed_or_reshaped_name(pin: Pin, expected: str) -> None:
    # The pins above can fail: the same checks on a library where the name moved.
    problem = pin.problem()
    assert problem is not None
    assert expected in problem
    assert Pin(_Library, "_send", ("self", "data"), read_by=(_Library.write,)).problem() is None


def test_pika_still_routes_every_frame_through_the_gathering_override() -> None:
    # Moved from test_gathering.py: if pika renames it, the override would be dead code.
    assert "_output_marshaled_frames" in vars(GatheringConnection)
    assert issubclass(GatheringConnection, pika.SelectConnection)


def test_encoded_properties_marshal_as_pikas_own() -> None:
    fields: dict[str, Any] = {
        "content_type": "application/json",
        "delivery_mode": 2,
        "correlation_id": "id-1",
    }
    ours = pika.frame.Header(1, 7, EncodedProperties(encode_properties(**fields))).marshal()
    pikas = pika.frame.Header(1, 7, pika.BasicProperties(**fields)).marshal()
    assert ours == pikas


def test_header_int_guard_encodes_32_bit_ints_and_installs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pamqp.encode, "table_integer", pamqp.encode.table_integer)  # undone after
    header_ints.install_header_int_guard()
    installed = pamqp.encode.table_integer
    header_ints.install_header_int_guard()
    assert pamqp.encode.table_integer is installed
    table = pamqp.encode.field_table({"n": 1, "big": 2**40})
    assert b"\x01nI" + struct.pack(">i", 1) in table
    assert b"\x03bigl" + struct.pack(">q", 2**40) in table


def test_failover_connection_overrides_the_pinned_hooks() -> None:
    assert "_on_connected" in vars(FailoverConnection)
    assert "_on_connection_close" in vars(FailoverConnection)
