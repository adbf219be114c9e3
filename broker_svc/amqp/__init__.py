"""Our own minimal AMQP 0-9-1 client (no pika): a pool child's and an election's connection."""
