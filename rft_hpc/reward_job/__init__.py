"""The reward job role: every explorer's reward-model calls scored in jobs of their own."""
