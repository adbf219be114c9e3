"""Pure decisions of the worker, unit-tested: no sockets, no AMQP client, no event loop."""
