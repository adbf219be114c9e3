"""What one worker of the cluster does at a time: a single active consumer per role, in transactions."""
