"""What a consuming child records beside a task's answer: state records, park records, task events."""
