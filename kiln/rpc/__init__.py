"""RPC plumbing: building servers, clients with retries, interceptors, auth, tensors on the wire."""
