"""The `spillway` command: argparse wiring only (`main`; `dlq` and `job` subcommands)."""
