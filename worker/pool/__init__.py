"""Task bodies in child processes; empty, so a pool child imports only what it runs."""
