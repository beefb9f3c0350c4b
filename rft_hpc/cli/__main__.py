"""`python -m rft_hpc.cli`: the same as the `rft-hpc` command (and how jobs start roles)."""

import sys

if sys.argv[1:2] == ["role"] and sys.argv[2:3] in (["explorer"], ["trainer"], ["reward"]):
    # Before the heavy imports: a stop signal now must not kill the role (see roles.signals).
    from rft_hpc.runtime.signals import catch_early

    catch_early()

from rft_hpc.cli.app import main

if __name__ == "__main__":
    main()
