"""`python -m cli` is the `flywheel` command."""

import sys

from cli.main import main

sys.exit(main())
