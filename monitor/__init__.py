"""GPU telemetry backends, risk scorers and the checkpoint-request flag writer."""

import logging as _logging

# A library stays quiet unless the application configures logging (the CLI does).
_logging.getLogger("ftmaster.monitor").addHandler(_logging.NullHandler())
