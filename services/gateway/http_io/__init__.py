"""HTTP plumbing every API shares: reading a JSON body, typed field readers, server-sent events."""
