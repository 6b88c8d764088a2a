"""ZeroMQ trajectory stream: record type, wire format, channels."""
