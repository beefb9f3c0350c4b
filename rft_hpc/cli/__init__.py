"""The `rft-hpc` command line: a thin layer over the library API."""
