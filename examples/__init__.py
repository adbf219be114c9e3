"""Example tasks and the demo that ``make run`` plays."""
