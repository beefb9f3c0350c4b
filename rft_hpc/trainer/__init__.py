"""The trainer: batches experiences, computes advantages and losses, updates the policy."""
