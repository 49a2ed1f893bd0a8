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

SERVER = _COMMON + [
    ("grpc.http2.min_ping_interval_without_data_ms", 4_000),
    ("grpc.http2.max_ping_strikes", 0),
]

CLIENT = _COMMON + [
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
