"""`python -m pagoda.entrypoints.launcher`: the whole stack on 127.0.0.1 (see the package docstring)."""

import sys

from pagoda.entrypoints.launcher.cli import main

sys.exit(main())
