"""The worker's side of the control plane: command handlers, Mingle, revokes."""
