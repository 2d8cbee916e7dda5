"""``python -m dorylus COMMAND ...``: the ``dorylus`` command (``python -m dorylus paramserver``
imports the parameter server and no other role)."""

import sys

from dorylus.cli import main

if __name__ == "__main__":
    sys.exit(main())
