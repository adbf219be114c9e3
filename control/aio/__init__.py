"""What a worker runs of the control plane (aio-pika): the mailbox node, its own broadcasts, declares."""
