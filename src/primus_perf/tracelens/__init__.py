"""Trace analysis: load -> link -> categorize -> perf models -> analyses; reports and compare.

Start at :func:`primus_perf.tracelens.analyze.analyze`.
"""
