"""Helpers shared by the test suites: workers, waits, AMQP, the mailbox, events, the CLI."""
