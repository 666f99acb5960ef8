"""The closed loop, ``primus-tune loop``: one pipeline of stages (``pipeline``), each calling
down into the profiler, the analyzer, the tuners and the trainer."""
