"""Memory shared by the worker and its children: files mapped by every process of one worker."""
