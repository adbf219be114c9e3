"""The mailbox vocabulary, pure: requests, commands, reply collection, membership, revoke log, signing."""
