"""The gateway's door to one scheduler: the Engine gRPC client and its multiplexed Session stream."""
