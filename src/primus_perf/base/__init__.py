"""The ground floor every layer stands on: errors, files, devices, the environment,
arguments and running a program's steps; imports nothing of primus_perf above it."""
