"""Clockwork's own records on its queues and streams: chord parts, dead letters, gates, parks, states."""
