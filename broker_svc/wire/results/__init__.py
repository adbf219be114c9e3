"""Result formats: the rpc result message, the key-value backends' stored map, the shared read view."""
