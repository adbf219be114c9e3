"""Signatures and the canvas made of them: chain, group, chord, and what follows a task."""
