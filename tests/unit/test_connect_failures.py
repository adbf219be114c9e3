"""A failed connection described in one line that says what to fix."""

from __future__ import annotations

import pika.exceptions

from broker_svc.connection.failures import describe_connect_error, is_permanent


def test_an_eof_on_the_tls_stream_is_named_as_tls():
    # What pika reported once the broker closed a TLS 1.3 stream before its alert was read.
    lost = pika.exceptions.StreamLostError(
        "Stream connection lost: SSLEOFError(8, 'EOF occurred in violation of protocol (_ssl.c:2427)')"
    )
    error = pika.exceptions.IncompatibleProtocolError(lost)
    text = describe_connect_error(error)
    assert text.startswith("TLS connection closed by the broker") and "SSLEOFError" in text
    assert not is_permanent(error)  # an EOF may also be the network: retried, not given up


def test_a_plain_lost_stream_is_not_called_tls():
    text = describe_connect_error(pika.exceptions.StreamLostError("Transport indicated EOF"))
    assert "TLS" not in text and "Transport indicated EOF" in text
