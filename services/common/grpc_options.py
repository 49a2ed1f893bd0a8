"""gRPC channel and server options shared by every service: message limits and keepalive.

Plans for long prompts carry every prompt token, so limits are generous; keepalive pings make a cut link (not
just a dead process) visible within seconds instead of at the next TCP timeout.
"""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# No SO_REUSEPORT (gRPC sets it by default on Linux): with it, a second scheduler started on a port already in use
# binds it too and the kernel splits new connections between the two, so gateways and workers of one cluster may
# reach the other. Without it, the second one fails to bind.
SERVER = _COMMON + [
    ("grpc.http2.min_ping_interval_without_data_ms", 4_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

# Reconnect attempts back off from 0.2 s to at most 2 s (gRPC's default grows to 120 s): a scheduler that comes
# back after a long outage is found within ~2 s by its workers and by the gateway's replica health checks.
CLIENT = _COMMON + [
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
