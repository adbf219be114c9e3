"""A consuming pool child (blocking): its own connection, and each delivery from decode to ack."""
