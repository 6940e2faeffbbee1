"""What the suites measure, one module per subcommand, and the helpers they share. Nothing here is an
entry point: run the suites in benchmarks/ (benchmarks/README.md)."""
