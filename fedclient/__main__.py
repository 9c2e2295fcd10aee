import sys

from fedclient.cli import main

sys.exit(main())
