"""`python -m server`: the specserve command line."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
