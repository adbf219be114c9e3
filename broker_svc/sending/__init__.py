"""From a signature to the broker: the task message, routes, dedup keys, the publisher."""
