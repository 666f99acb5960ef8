"""Trace loading, op->kernel linking, perf models, breakdowns, reports, compare, gate."""
