"""The `pagoda` console script (pyproject `[project.scripts]`): `pagoda serve MODEL [flags]` starts
the whole stack (the launcher, pagoda/entrypoints/launcher), `pagoda chat` talks to a running one
from the terminal. `main` parses the subcommand; `serve` and `chat` each add their own parser."""
