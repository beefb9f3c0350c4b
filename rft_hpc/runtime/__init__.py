"""What role processes share: stop signals, heartbeats, the job clock, threads, frozen config."""
