package broker

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the broker's domain metrics:
//
//	tokenbroker_issuances_total{outcome}                   kubeconfig requests by outcome
//	tokenbroker_issuance_duration_seconds{outcome}         time to decide and issue, API calls included
//	tokenbroker_issuance_own_seconds{outcome}              the broker's own time per kubeconfig request: the
//	                                                       issuance duration less the time spent waiting on
//	                                                       the API server
//	tokenbroker_apiserver_call_duration_seconds{call}      time spent waiting on the API server per call
//	tokenbroker_leases_deleted_total{reason}               leases revoked on request or collected on expiry
//	tokenbroker_certificate_requests_total{operation,outcome}
//	                                                       enrollments and renewals (operation "enroll" or
//	                                                       "renew") by outcome: issued, unauthenticated,
//	                                                       invalid, denied, unavailable, error
//	tokenbroker_config_reloads_total{config,result}        reloads of "policy", "server-certificate" and
//	                                                       "client-ca" by result, "success" or "failure"
//	tokenbroker_revocations{kind}                          entries of the revocation deny list in force,
//	                                                       by kind ("identity", "serial")
//
// A nil *Metrics records nothing.
type Metrics struct {
	issuances   *prometheus.CounterVec
	issueDur    *prometheus.HistogramVec
	issueOwn    *prometheus.HistogramVec
	apiCall     *prometheus.HistogramVec
	deleted     *prometheus.CounterVec
	certs       *prometheus.CounterVec
	reloads     *prometheus.CounterVec
	revocations *prometheus.GaugeVec
}

// The config label values of tokenbroker_config_reloads_total.
const (
	ConfigPolicy            = "policy"
	ConfigServerCertificate = "server-certificate"
	ConfigClientCA          = "client-ca"
)

// NewMetrics creates the broker metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	buckets := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	m := &Metrics{
		issuances: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokenbroker_issuances_total",
			Help: "Kubeconfig requests by outcome.",
		}, []string{"outcome"}),
		issueDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tokenbroker_issuance_duration_seconds",
			Help:    "Time to decide and issue a kubeconfig, API server calls included.",
			Buckets: buckets,
		}, []string{"outcome"}),
		issueOwn: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "tokenbroker_issuance_own_seconds",
			Help: "The broker's own time per kubeconfig request: the issuance duration less the time spent waiting on the API server.",
			// Finer at the low end: this is CPU time of the broker, tens of
			// microseconds to a millisecond.
			Buckets: []float64{.00005, .0001, .00025, .0005, .00075, .001, .0015, .002, .003, .005, .01, .025, .1},
		}, []string{"outcome"}),
		apiCall: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tokenbroker_apiserver_call_duration_seconds",
			Help:    "Time spent waiting on the Kubernetes API server, by call.",
			Buckets: buckets,
		}, []string{"call"}),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokenbroker_leases_deleted_total",
			Help: "Lease Secrets deleted, by reason (revoked, expired).",
		}, []string{"reason"}),
		certs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokenbroker_certificate_requests_total",
			Help: "Certificate enrollments and renewals, by operation and outcome.",
		}, []string{"operation", "outcome"}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokenbroker_config_reloads_total",
			Help: "Reloads of changed configuration files, by config (policy, server-certificate, client-ca) and result (success, failure).",
		}, []string{"config", "result"}),
		revocations: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tokenbroker_revocations",
			Help: "Entries of the revocation deny list in force, by kind (identity, serial).",
		}, []string{"kind"}),
	}
	for _, c := range []prometheus.Collector{m.issuances, m.issueDur, m.issueOwn, m.apiCall, m.deleted, m.certs, m.reloads, m.revocations} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) observeIssue(outcome string, total, own time.Duration) {
	if m == nil {
		return
	}
	m.issuances.WithLabelValues(outcome).Inc()
	m.issueDur.WithLabelValues(outcome).Observe(total.Seconds())
	m.issueOwn.WithLabelValues(outcome).Observe(own.Seconds())
}

func (m *Metrics) observeAPI(call string, d time.Duration) {
	if m == nil {
		return
	}
	m.apiCall.WithLabelValues(call).Observe(d.Seconds())
}

func (m *Metrics) leaseDeleted(reason string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.deleted.WithLabelValues(reason).Add(float64(n))
}

func (m *Metrics) observeCertificate(operation, outcome string) {
	if m == nil {
		return
	}
	m.certs.WithLabelValues(operation, outcome).Inc()
}

// ObserveReload counts one reload attempt of a changed configuration file:
// config is ConfigPolicy, ConfigServerCertificate or ConfigClientCA; a nil
// err counts a success, any other a failure (the old configuration stays in
// force). The composition root calls it from the pki reloaders' callbacks.
func (m *Metrics) ObserveReload(config string, err error) {
	if m == nil {
		return
	}
	result := "success"
	if err != nil {
		result = "failure"
	}
	m.reloads.WithLabelValues(config, result).Inc()
}

func (m *Metrics) setRevocations(identities, serials int) {
	if m == nil {
		return
	}
	m.revocations.WithLabelValues("identity").Set(float64(identities))
	m.revocations.WithLabelValues("serial").Set(float64(serials))
}
