"""`python -m pagoda.entrypoints.cli`: the `pagoda` console script without an installed package."""

import sys

from pagoda.entrypoints.cli.main import main

sys.exit(main())
