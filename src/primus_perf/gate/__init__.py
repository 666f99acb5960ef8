"""Performance regression gate: repeated measurement of the trainer (:mod:`.bench`) and the
statistical decision (:mod:`.gate`, :mod:`.stats`)."""
