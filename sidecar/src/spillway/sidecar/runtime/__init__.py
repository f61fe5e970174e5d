"""The process: wiring a sidecar from its properties and serving it (`bootstrap`), several
processes behind one address (`processes`), shutdown, memory and GC tuning of a long-running
process, start-up refusals over stranded spools, and the embedded broker for `make run`."""
