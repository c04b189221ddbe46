"""``python -m fedhet`` runs the command line."""

from fedhet.cli import main

raise SystemExit(main())
