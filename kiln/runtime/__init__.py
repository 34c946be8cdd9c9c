"""What generated kernels import at run time (nothing here knows about stages)."""
