"""The helpers the suites share (options, results, the harness, the machine, the TTFT workload and report, the
peers, the cluster). Nothing here is an entry point or a subcommand: those live in benchmarks/suites/SUITE/, run
by the suites in benchmarks/ (benchmarks/README.md)."""
