"""The worker's broker connections, its task-queue subscriptions and the consume channel's watch."""
