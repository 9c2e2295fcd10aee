import sys

from fedserver.cli import main

sys.exit(main())
