"""`python -m kiln`: the command line (kiln.apps.cli)."""

from kiln.apps.cli import main

raise SystemExit(main())
