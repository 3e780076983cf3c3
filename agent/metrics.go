package agent

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	brokermetrics "github.com/tokenbroker/tokenbroker/broker/metrics"
)

// Result label values.
const (
	resultSuccess = "success"
	resultFailure = "failure"
)

// metrics are the agent's counters and gauges; the package doc lists them.
// Expiries are computed at scrape time by expiryCollector, never set
// ahead, so that they cannot go stale.
type metrics struct {
	refresh      *prometheus.CounterVec
	lastSuccess  *prometheus.GaugeVec
	outputWrites *prometheus.CounterVec
	revocations  *prometheus.CounterVec
	renewals     *prometheus.CounterVec
	// clusterCARefusals counts renewals whose cluster CA the broker
	// refused (it signs none): the client certificate was renewed
	// without it, and the pod signer signs nothing until one comes.
	clusterCARefusals prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		refresh:      brokermetrics.NewCounterVec("tokenbroker_agent_refresh_total", "Attempts to obtain a credential and write it to every output of a target, by result (success, failure).", "target", "result"),
		lastSuccess:  brokermetrics.NewGaugeVec("tokenbroker_agent_last_success_timestamp_seconds", "Unix time of a target's last successful refresh.", "target"),
		outputWrites: brokermetrics.NewCounterVec("tokenbroker_agent_output_writes_total", "Writes of a credential to an output, by result (written, unchanged, failed).", "target", "output", "result"),
		revocations:  brokermetrics.NewCounterVec("tokenbroker_agent_revocations_total", "Revocations of replaced leases, by result (success, failure).", "target", "result"),
		renewals:     brokermetrics.NewCounterVec("tokenbroker_agent_certificate_renewals_total", "Renewals of the agent's client certificate, by result (success, failure).", "result"),
		clusterCARefusals: brokermetrics.NewCounter("tokenbroker_agent_cluster_ca_refusals_total",
			"Renewals whose cluster CA the broker refused (it signs none); the client certificate was renewed without it and the pod signer signs nothing until a renewal gets one."),
	}
	if err := brokermetrics.Register(reg, m.refresh, m.lastSuccess, m.outputWrites, m.revocations, m.renewals, m.clusterCARefusals); err != nil {
		return nil, fmt.Errorf("register agent metrics: %w", err)
	}
	for _, r := range []string{resultSuccess, resultFailure} {
		m.renewals.WithLabelValues(r)
	}
	return m, nil
}

// initTarget makes a target's series exist at zero from the start, so that
// rate() and absence alerts work before the first failure.
func (m *metrics) initTarget(target string, outputs []output) {
	for _, r := range []string{resultSuccess, resultFailure} {
		m.refresh.WithLabelValues(target, r)
		m.revocations.WithLabelValues(target, r)
	}
	for _, o := range outputs {
		for _, r := range []writeResult{resultWritten, resultUnchanged, resultFailed} {
			m.outputWrites.WithLabelValues(target, o.String(), string(r))
		}
	}
}

// expiryCollector reports, at scrape time, the seconds until each target's
// credential and the agent's certificate expire (negative once expired).
// A target holding no credential yet, or an agent without a certificate
// yet, has no sample.
type expiryCollector struct {
	now      func() time.Time
	targets  []*refresher
	identity *identityHolder
	credDesc *prometheus.Desc
	certDesc *prometheus.Desc
}

var _ prometheus.Collector = (*expiryCollector)(nil)

func newExpiryCollector(now func() time.Time, targets []*refresher, id *identityHolder) *expiryCollector {
	return &expiryCollector{
		now: now, targets: targets, identity: id,
		credDesc: prometheus.NewDesc("tokenbroker_agent_credential_expiry_seconds",
			"Seconds until the credential of a target expires: the earliest expiry among its outputs.",
			[]string{"target"}, nil),
		certDesc: prometheus.NewDesc("tokenbroker_agent_certificate_expiry_seconds",
			"Seconds until the agent's client certificate expires.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *expiryCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.credDesc
	ch <- c.certDesc
}

// Collect implements prometheus.Collector.
func (c *expiryCollector) Collect(ch chan<- prometheus.Metric) {
	now := c.now()
	for _, r := range c.targets {
		if exp, ok := r.status().expiry(); ok {
			ch <- prometheus.MustNewConstMetric(c.credDesc, prometheus.GaugeValue, exp.Sub(now).Seconds(), r.name)
		}
	}
	if leaf := c.identity.leaf(); leaf != nil {
		ch <- prometheus.MustNewConstMetric(c.certDesc, prometheus.GaugeValue, leaf.NotAfter.Sub(now).Seconds())
	}
}
