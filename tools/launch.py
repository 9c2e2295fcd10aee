"""Temporary alias of :mod:`fedguard.launch` for experiment drivers started before the move (removed next)."""

import sys

from fedguard.launch import main

if __name__ == "__main__":
    sys.exit(main())
