// Package server is the HTTP layer of tokenbroker: the mutual-TLS API
// listener, the plain-HTTP operations listener, the chi route table under
// /v1, the middleware chain and the handlers that decode a request, validate
// it, call the broker and encode the answer. It holds no domain logic; the
// broker package decides, this package translates.
//
// Every error answer is an RFC 9457 problem+json rendered by one function,
// writeError, which maps a *broker.Error Kind to a status. Answers for
// 401, 403 and 5xx carry a fixed message; the cause goes to the log with the
// request id.
//
// The TLS settings are not built here: New receives a *tls.Config (from the
// pki package, in the composition root) and the peer identity is taken from
// the verified client certificate's SPIFFE URI SAN.
//
// # Metrics
//
// Registered on the prometheus.Registerer given in Config (never the global
// default registry) and served on the operations listener at /metrics:
//
//   - tokenbroker_http_requests_total{route,method,code}: counter of API
//     requests answered, by chi route pattern ("unmatched" for requests that
//     match no route), HTTP method ("OTHER" for non-standard ones) and
//     status code.
//   - tokenbroker_http_request_duration_seconds{route}: histogram of the time
//     from the start of the middleware chain to the handler's return.
//
// Requests to the operations listener (/healthz, /readyz, /metrics) are not
// counted and not access-logged.
package server
