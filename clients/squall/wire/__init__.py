"""What the client library and the services agree on across the wire, without the transport.

`squall.wire` is public and imports no grpc (only the standard library, and the
OpenTelemetry API for trace context), so the client library (`squall`, `squall.aio`) and
the services (the gateway's retries, the server interceptors, the CLI) apply the same
rules from the same code, and a tool that speaks to Squall over its own gRPC stack can
reuse them:

* `squall.wire.retry`: what a failed attempt means (ok / definite / indeterminate, from a
  status code *name*), when it may be retried, and the `RetryPolicy` time budget;
* `squall.wire.auth`: where a bearer token comes from (`SQUALL_TOKEN`,
  `SQUALL_TOKEN_FILE`), what a valid one looks like, and the `authorization` metadata
  that carries it;
* `squall.wire.long_poll`: how long a call may wait because its request asks it to (a
  shared subscription's `Pull` and its `wait_ms`), which every hop's deadline must cover;
* `squall.wire.trace_context`: the W3C `traceparent`/`tracestate` metadata that carries
  OpenTelemetry context between processes, the RPC span names and attributes, and which
  status codes mark a span as failed.

The grpc-bound parts (channel interceptors) stay in the client library and the services.
"""
