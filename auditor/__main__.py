"""``python -m auditor …``: the ``verbatim`` command (see ``auditor.cli``)."""

import sys

from auditor.cli import main

sys.exit(main(prog="python -m auditor"))
