"""GPU telemetry backends, risk scorers and the checkpoint-request flag writer."""
