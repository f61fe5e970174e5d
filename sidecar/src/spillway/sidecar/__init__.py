"""spillway sidecar: the per-node process that decides, spools and dead-letters."""
