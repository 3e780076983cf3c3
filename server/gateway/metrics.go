package gateway

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokenbroker/tokenbroker/broker/metrics"
)

// Metrics are the gateway's: forwarded requests by peer and status
// class, their duration, open connections by peer, and the connections
// ended by revocation or expiry, and the rechecks of leases with the API
// server while the lease counter is blind. Per-lease counts are in the audit
// events, which name the lease (a lease label would grow without bound).
// A nil *Metrics records nothing.
type Metrics struct {
	requests   *prometheus.CounterVec
	duration   prometheus.Histogram
	open       *prometheus.GaugeVec
	endedConns *prometheus.CounterVec
	rechecks   *prometheus.CounterVec
	inFlight   prometheus.Gauge
}

// Outcomes of a recheck (Metrics.rechecks).
const (
	recheckLive  = "live"
	recheckGone  = "gone"
	recheckError = "error"
)

// NewMetrics registers the gateway's metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		requests:   metrics.NewCounterVec("tokenbroker_gateway_requests_total", "Requests of gateway leases, by peer identity and status class (2xx, 4xx, 5xx; 1xx for upgrades).", "identity", "code"),
		duration:   metrics.NewHistogram("tokenbroker_gateway_request_duration_seconds", "Duration of gateway requests, watches and streams included, until they end.", []float64{0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10, 60, 600, 3600}),
		open:       metrics.NewGaugeVec("tokenbroker_gateway_connections", "Open connections of gateway leases, by peer identity.", "identity"),
		endedConns: metrics.NewCounterVec("tokenbroker_gateway_connections_ended_total", "Connections of gateway leases the gateway ended, by reason: revoked (the lease Secret went), expired, denied (deny list).", "reason"),
		rechecks:   metrics.NewCounterVec("tokenbroker_gateway_lease_rechecks_total", "Leases the gateway asked the API server about because the lease counter was blind to their namespace (its watch broken), by outcome: live, gone, error (no answer: the request was refused 503).", "outcome"),
	}
	m.inFlight = metrics.NewGauge("tokenbroker_gateway_requests_in_flight", "Requests of gateway leases under way (watches and streams included), counted from their forwarding to their end.")
	for _, outcome := range []string{recheckLive, recheckGone, recheckError} {
		m.rechecks.WithLabelValues(outcome)
	}
	if err := metrics.Register(reg, m.requests, m.duration, m.open, m.endedConns, m.rechecks, m.inFlight); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *Metrics) request(peer string, code int, d time.Duration) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(peer, strconv.Itoa(code/100)+"xx").Inc()
	m.duration.Observe(d.Seconds())
}

func (m *Metrics) connOpened(peer string) {
	if m != nil {
		m.open.WithLabelValues(peer).Inc()
	}
}

func (m *Metrics) connClosed(peer string) {
	if m != nil {
		m.open.WithLabelValues(peer).Dec()
	}
}

func (m *Metrics) ended(reason string, n int) {
	if m != nil && n > 0 {
		m.endedConns.WithLabelValues(reason).Add(float64(n))
	}
}

func (m *Metrics) recheck(outcome string) {
	if m != nil {
		m.rechecks.WithLabelValues(outcome).Inc()
	}
}

func (m *Metrics) inflight(delta float64) {
	if m == nil {
		return
	}
	m.inFlight.Add(delta)
}
