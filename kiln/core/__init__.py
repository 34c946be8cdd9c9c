"""Foundation every layer uses: errors (one type per status code), limits, tracing, metrics."""
