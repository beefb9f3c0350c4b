"""Models and tokenizers built locally (nothing is ever fetched from a hub)."""
