"""Console entry points: thin typer apps over the library (parse, call, render)."""
