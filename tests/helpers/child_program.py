"""A program for the fork-server tests (`python -m helpers.child_program SECONDS CODE`):
prints its arguments, its session id and `CHILD_VALUE`, sleeps SECONDS, exits with CODE;
SIGTERM makes it print "terminated" and exit 15 (an atexit handler prints "atexit")."""

import atexit
import os
import signal
import sys
import time


def _terminated(*_: object) -> None:
    print("terminated")
    sys.exit(15)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    atexit.register(print, "atexit")
    seconds, code = float(sys.argv[1]), int(sys.argv[2])
    print("argv", sys.argv[1:], "own session", os.getsid(0) == os.getpid(),
          "value", os.environ.get("CHILD_VALUE"))
    time.sleep(seconds)
    sys.exit(code)
