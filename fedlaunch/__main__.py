"""``python -m fedlaunch``: the launcher (``fedguard-launch``); ``python -m fedlaunch worker --spec FILE`` hosts
virtual clients."""

import sys

from fedlaunch.cli import main

sys.exit(main())
