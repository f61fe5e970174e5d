"""spillway's benchmark harness (issue 7).

    python -m bench                 # full run: every target, writes docs/BENCHMARKS.md
    python -m bench --short         # small enough for CI (a few minutes)
    python -m bench --only rpc,8    # chosen targets, by name or number

It starts what the targets need — a fresh Tansu broker per target, sidecars as their own
processes through `spillway serve`, client processes, local Spark — alternates baseline and
candidate runs (ABAB…), and reports medians and min–max over several runs, each target's
ratio, its threshold and whether it is met. Figures are reported, never asserted.

Layout: `stats`, `model` and `report` are pure (tested in tests/unit/project/test_bench_harness.py);
`infra`, `clients`, `profiling` start and watch processes, `cpu` reads their CPU counters;
`loadgen`, `echo` and `produce` are the programs those processes run; `targets` holds the
targets (11, `cluster`: node sidecars forwarding to one home, CPU per record by role).
"""
