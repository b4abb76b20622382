"""``python -m comet ...`` is the ``comet`` command."""

from comet.cli.main import main

raise SystemExit(main())
