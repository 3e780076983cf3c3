package server

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokenbroker/tokenbroker/broker/metrics"
)

// routeUnmatched labels requests that match no route, so that scanners
// cannot grow the label set.
const routeUnmatched = "unmatched"

// httpMetrics are the metrics listed in the package doc.
type httpMetrics struct {
	requests    *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	handshakes  *prometheus.CounterVec
	refused     *prometheus.CounterVec
	openConns   *prometheus.GaugeVec
	inHandshake *prometheus.GaugeVec
}

func newHTTPMetrics(reg prometheus.Registerer) (*httpMetrics, error) {
	m := &httpMetrics{
		requests:    metrics.NewCounterVec("tokenbroker_http_requests_total", "API requests answered, by listener, route pattern, method and status code.", "listener", "route", "method", "code"),
		duration:    metrics.NewHistogramVec("tokenbroker_http_request_duration_seconds", "Time to answer an API request, by listener and route pattern.", prometheus.DefBuckets, "listener", "route"),
		handshakes:  metrics.NewCounterVec("tokenbroker_tls_handshake_failures_total", "TLS handshakes that failed on an API listener, by listener and reason.", "listener", "reason"),
		refused:     metrics.NewCounterVec("tokenbroker_connections_refused_total", "Connections closed unanswered over a cap, by listener and reason (per_ip, per_ip_handshakes, conns, handshakes, per_identity).", "listener", "reason"),
		openConns:   metrics.NewGaugeVec("tokenbroker_connections_open", "Open connections of the TLS listeners, handshakes included, by listener.", "listener"),
		inHandshake: metrics.NewGaugeVec("tokenbroker_connections_handshaking", "Connections of the TLS listeners still in their TLS handshake, by listener.", "listener"),
	}
	if err := metrics.Register(reg, m.requests, m.duration, m.handshakes, m.refused, m.openConns, m.inHandshake); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *httpMetrics) observe(listener, route, method string, status int, d time.Duration) {
	m.requests.WithLabelValues(listener, route, method, strconv.Itoa(status)).Inc()
	m.duration.WithLabelValues(listener, route).Observe(d.Seconds())
}

func (m *httpMetrics) handshakeFailed(listener, reason string) {
	m.handshakes.WithLabelValues(listener, reason).Inc()
}

func (m *httpMetrics) connectionRefused(listener, reason string) {
	m.refused.WithLabelValues(listener, reason).Inc()
}

func (m *httpMetrics) connectionsOpen(listener string, delta float64) {
	m.openConns.WithLabelValues(listener).Add(delta)
}

func (m *httpMetrics) connectionsHandshaking(listener string, delta float64) {
	m.inHandshake.WithLabelValues(listener).Add(delta)
}

// methodLabel bounds the method label (and log field) to the standard
// methods; anything else is "OTHER".
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return m
	default:
		return "OTHER"
	}
}
