"""Running an experiment: stages, role processes, live display, summary and report."""
