"""spillway sidecar: the per-node process that decides, spools and dead-letters."""

__version__ = "0.1.0"
