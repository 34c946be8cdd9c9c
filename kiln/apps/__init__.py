"""Applications on top of the stages: the CLI, `kiln serve`, bench, demo, farm, load test, show,
the trace viewer and the OpenAI-compatible server."""
