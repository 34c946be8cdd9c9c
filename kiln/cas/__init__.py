"""Content-addressed storage: digests, blob stores (file, S3), the action cache and leases."""
