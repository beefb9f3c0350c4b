"""`python -m rft_hpc.cli`: the same as the `rft-hpc` command."""

from rft_hpc.cli.app import main

if __name__ == "__main__":
    main()
