"""spillway for PySpark: wrappers that route failed records to the sidecar."""
