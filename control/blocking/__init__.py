"""The blocking control client (pika): broadcast, collect replies, read the members and events streams."""
