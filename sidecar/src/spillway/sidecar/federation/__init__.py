"""Sidecar to sidecar: a run's home and its nodes.

`peers` dials a run's home (and its nodes from the home); `tallying` is the home protocol's two
sides; `confirm` and `node_slices` are a node's provisional verdicts and its slices of a run's
error budget; `coalesce` groups a run's reports bound for its home; `siblings` routes a run to
the process of a several-process sidecar that homes it.
"""
