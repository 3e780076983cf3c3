// Package server is the HTTP layer of tokenbroker: the mutual-TLS API
// listener, the optional enrollment listener, the plain-HTTP operations
// listener, the chi route table under /v1, the middleware chain and the
// handlers that decode a request, validate it, call the broker and encode
// the answer. It holds no domain logic; the broker package decides, this
// package translates.
//
// # Two API listeners
//
// The mutual-TLS listener requires and verifies a client certificate in the
// TLS handshake, and its authentication middleware runs before every
// handler: it takes the caller's SPIFFE identity from the verified leaf and
// refuses (401) a certificate outside its validity, one whose CA has left
// the client-CA bundle (Config.ClientCAs) and one whose identity or serial
// the broker's deny list revokes (RevocationChecker), on every request, so
// keep-alive connections included. POST /v1/certificates there is renewal.
//
// A cluster that has no certificate yet enrolls on the enrollment listener
// (Config.EnrollAddr), whose TLS profile asks for no client certificate. It
// serves exactly two routes of the one route table: POST /v1/certificates
// with a join token as the bearer token, and GET /v1/trust-bundle; every
// other path is 404. Every failure of the join token is the same 401, with
// a WWW-Authenticate: Bearer challenge.
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
//   - tokenbroker_http_requests_total{listener,route,method,code}: counter of
//     API requests answered, by listener ("api" or "enroll"), chi route
//     pattern ("unmatched" for requests that match no route), HTTP method
//     ("OTHER" for non-standard ones) and status code.
//   - tokenbroker_http_request_duration_seconds{listener,route}: histogram of
//     the time from the start of the middleware chain to the handler's
//     return.
//   - tokenbroker_tls_handshake_failures_total{listener,reason}: counter of
//     refused TLS handshakes on the api and enroll listeners, by reason (see
//     HandshakeReasons). The listeners do the handshake themselves, before
//     net/http sees the connection, so that the failure is classified from
//     its typed error; each is also logged ("TLS handshake failed"),
//     rate-limited, with the remote address and the subject and SPIFFE ID of
//     a refused certificate, nothing else of it.
//   - tokenbroker_connections_refused_total{listener,reason}: counter of
//     connections closed over a cap (see ConnRefusedReasons): per_ip
//     (Config.MaxConnsPerIP), per_ip_handshakes (Config.MaxHandshakesPerIP),
//     conns (Config.MaxConns), handshakes (Config.MaxHandshakes), all four
//     as soon as the connection is accepted, before any TLS state is made
//     for it; or per_identity (Config.MaxConnsPerIdentity), after the
//     handshake.
//   - tokenbroker_connections_open{listener}: gauge of the open
//     connections of the api and enroll listeners, handshakes included.
//   - tokenbroker_connections_handshaking{listener}: gauge of those still
//     in their TLS handshake.
//
// Requests to the operations listener (/healthz, /readyz, /metrics) are not
// counted and not access-logged.
package server
