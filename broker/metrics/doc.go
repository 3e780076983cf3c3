// Package metrics defines every metric of the broker's domain, with
// Prometheus naming and help text, and the methods that record them; it
// decides nothing and imports no other tokenbroker package. The names and
// labels are a contract: the charts' alerts and the Grafana dashboard read
// them.
//
// New registers the metrics listed on Metrics on the registry it is
// given (never the global one), with Prometheus naming and help text:
// issuances by outcome, their duration and the broker's own share of it,
// the time of each issuer call, credentials issued by peer, namespace and
// ServiceAccount, requested and granted TTLs, clamps, denials by action and
// reason, API server call durations and errors, active leases and the
// garbage collector's passes, deleted leases, certificate requests, the
// expiry of the server certificate, the signing CA and the client-CA
// bundle (read at every scrape), configuration reloads
// (tokenbroker_config_reloads_total{config,result}, also fed by the
// composition root for the server certificate and client-CA reloaders),
// the size of the deny list, audit events and build information.
//
// NewCounter, NewCounterVec, NewGauge, NewGaugeVec, NewHistogram,
// NewHistogramVec and Register are how every tokenbroker metric is
// declared and registered: this package's, the server's HTTP and lease
// gateway metrics, and the agent's (the one broker package the agent
// imports; it imports only Prometheus).
package metrics
