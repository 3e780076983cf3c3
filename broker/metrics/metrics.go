package metrics

import (
	"slices"
	"sync"
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
//	tokenbroker_leases_deleted_total{reason}               leases revoked on request, collected on expiry, or
//	                                                       revoked as "unmatched" (see below), "unclaimed" or
//	                                                       "tampered"
//	tokenbroker_certificate_requests_total{operation,outcome}
//	                                                       enrollments and renewals (operation "enroll" or
//	                                                       "renew") by outcome: issued, unauthenticated,
//	                                                       invalid, denied, unavailable, error
//	tokenbroker_config_reloads_total{config,result}        reloads of "policy", "server-certificate" and
//	                                                       "client-ca" by result, "success" or "failure"
//	tokenbroker_revocations{kind}                          entries of the revocation deny list in force,
//	                                                       by kind ("identity", "serial")
//	tokenbroker_issuer_duration_seconds{issuer,result}     time in one issuer call (issuer "token": the
//	                                                       TokenRequest), result "success" or "error"
//	tokenbroker_credentials_issued_total{peer,namespace,service_account,credential}
//	                                                       credentials handed out; the label values are
//	                                                       bounded by the policy's grants
//	tokenbroker_requested_ttl_seconds                      TTLs peers asked for (requests that named one)
//	tokenbroker_granted_ttl_seconds                        TTLs granted
//	tokenbroker_ttl_clamps_total{by}                       granted TTLs shorter than asked, by the limit
//	                                                       that shortened them (grant.maxTTL,
//	                                                       policy.maxTTL, lease.minimum, apiserver, signer)
//	tokenbroker_denials_total{action,reason}               refused requests by action (issue, revoke,
//	                                                       enroll, renew, authenticate) and reason code
//	                                                       (not_granted, audience_not_granted, min_ttl,
//	                                                       credential_unavailable, invalid, not_found,
//	                                                       join_token, revoked, identity_mismatch,
//	                                                       disabled, not_signing_ca, not_a_peer; for
//	                                                       authenticate
//	                                                       the Refused* codes)
//	tokenbroker_leases_active                              unexpired lease Secrets seen by the last
//	                                                       successful GC pass, cluster-wide (every
//	                                                       replica reports the same: aggregate with max)
//	tokenbroker_lease_gc_runs_total{result}                GC passes, "success" or "failure"
//	tokenbroker_lease_gc_duration_seconds                  time of one GC pass
//	tokenbroker_lease_gc_last_success_timestamp_seconds    Unix time of the last successful GC pass
//	tokenbroker_lease_deletions_pending                    lease deletions that failed and wait for a
//	                                                       retry (revocations answered 503, expired
//	                                                       leases the GC could not delete, leases of
//	                                                       failed requests); 0 when all are done
//	tokenbroker_certificate_expiry_timestamp_seconds{certificate}
//	                                                       NotAfter (Unix time) of the "server"
//	                                                       certificate, the signing "ca" and the
//	                                                       earliest of the "client-ca" bundle
//	tokenbroker_apiserver_call_errors_total{call,reason}   failed API server calls by call and reason
//	                                                       (unavailable, forbidden, not_found,
//	                                                       conflict, invalid, other)
//	tokenbroker_audit_events_total{action,decision}        audit events written (see audit.Event)
//	tokenbroker_audit_write_errors_total                   audit events that could not be written
//	tokenbroker_build_info{version,revision,goversion}     1, labelled with the build
//	tokenbroker_limited_total{peer,reason}                 requests refused with 429 by a limit, by peer
//	                                                       ("" for enrollments) and reason
//	                                                       (issuance_rate, renewal_rate, enrollment_rate,
//	                                                       max_live_leases, global_max_live_leases,
//	                                                       lease_read_rate, lease_reads_in_flight)
//	tokenbroker_unmatched_revocations_total{reason}        leases revoked because their namespace stopped
//	                                                       being covered by the selector grant they were
//	                                                       issued under: label_changed, namespace_deleted,
//	                                                       policy_narrowed, found_at_start, found_by_gc
//	                                                       (counted by the replica whose delete removed
//	                                                       the lease)
//	tokenbroker_selector_namespaces{peer,grant}            namespaces a grant's namespaceSelector matches now
//	tokenbroker_lease_pool_issuances_total{path}           token issuances by path: "pool" (a pre-created
//	                                                       lease Secret claimed, TokenRequest and claim in
//	                                                       parallel) or "sequential" (Secret, then token)
//	tokenbroker_lease_pool_ready                           unclaimed pre-created lease Secrets this replica
//	                                                       holds
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

	issuerDur    *prometheus.HistogramVec
	issued       *prometheus.CounterVec
	requestedTTL prometheus.Histogram
	grantedTTL   prometheus.Histogram
	clamps       *prometheus.CounterVec
	denials      *prometheus.CounterVec
	activeLeases prometheus.Gauge
	gcRuns       *prometheus.CounterVec
	gcDur        prometheus.Histogram
	gcLast       prometheus.Gauge
	pendingDel   prometheus.Gauge
	certExpiry   *expiryCollector
	apiErrors    *prometheus.CounterVec
	auditEvents  *prometheus.CounterVec
	auditErrors  prometheus.Counter
	buildInfo    *prometheus.GaugeVec
	limited      *prometheus.CounterVec
	unmatched    *prometheus.CounterVec
	selectorNS   *prometheus.GaugeVec
	poolIssued   *prometheus.CounterVec
	poolReady    prometheus.Gauge
}

// The certificate label values of
// tokenbroker_certificate_expiry_timestamp_seconds.
const (
	CertificateServer   = "server"
	CertificateCA       = "ca"
	CertificateClientCA = "client-ca"
)

// The config label values of tokenbroker_config_reloads_total.
const (
	ConfigPolicy            = "policy"
	ConfigServerCertificate = "server-certificate"
	ConfigClientCA          = "client-ca"
	ConfigCA                = "ca"
	ConfigPreviousCA        = "previous-ca"
)

// New creates the broker metrics and registers them with reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	buckets := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	m := &Metrics{
		issuances: NewCounterVec("tokenbroker_issuances_total", "Kubeconfig requests by outcome.", "outcome"),
		issueDur:  NewHistogramVec("tokenbroker_issuance_duration_seconds", "Time to decide and issue a kubeconfig, API server calls included.", buckets, "outcome"),
		// Finer buckets at the low end: this is CPU time of the broker, tens
		// of microseconds to a millisecond.
		issueOwn: NewHistogramVec("tokenbroker_issuance_own_seconds", "The broker's own time per kubeconfig request: the issuance duration less the time spent waiting on the API server.",
			[]float64{.00005, .0001, .00025, .0005, .00075, .001, .0015, .002, .003, .005, .01, .025, .1}, "outcome"),
		apiCall:      NewHistogramVec("tokenbroker_apiserver_call_duration_seconds", "Time spent waiting on the Kubernetes API server, by call.", buckets, "call"),
		deleted:      NewCounterVec("tokenbroker_leases_deleted_total", "Lease Secrets deleted, by reason (revoked, expired, unmatched, unclaimed, tampered).", "reason"),
		certs:        NewCounterVec("tokenbroker_certificate_requests_total", "Certificate enrollments and renewals, by operation and outcome.", "operation", "outcome"),
		reloads:      NewCounterVec("tokenbroker_config_reloads_total", "Reloads of changed configuration files, by config (policy, server-certificate, client-ca) and result (success, failure).", "config", "result"),
		revocations:  NewGaugeVec("tokenbroker_revocations", "Entries of the revocation deny list in force, by kind (identity, serial).", "kind"),
		issuerDur:    NewHistogramVec("tokenbroker_issuer_duration_seconds", "Time in one issuer call (issuer token: the TokenRequest), by issuer and result (success, error).", buckets, "issuer", "result"),
		issued:       NewCounterVec("tokenbroker_credentials_issued_total", "Credentials issued, by peer, namespace, ServiceAccount and credential kind.", "peer", "namespace", "service_account", "credential"),
		requestedTTL: NewHistogram("tokenbroker_requested_ttl_seconds", "TTLs peers asked for, in seconds (requests that named one).", ttlBuckets),
		grantedTTL:   NewHistogram("tokenbroker_granted_ttl_seconds", "TTLs granted, in seconds.", ttlBuckets),
		clamps:       NewCounterVec("tokenbroker_ttl_clamps_total", "Granted TTLs shorter or longer than asked, by the limit that decided (grant.maxTTL, policy.maxTTL, lease.minimum, apiserver, signer).", "by"),
		denials:      NewCounterVec("tokenbroker_denials_total", "Refused requests, by action (issue, revoke, enroll, renew, authenticate) and reason code.", "action", "reason"),
		activeLeases: NewGauge("tokenbroker_leases_active", "Unexpired lease Secrets seen by the last successful garbage collection pass, cluster-wide (the same on every replica)."),
		gcRuns:       NewCounterVec("tokenbroker_lease_gc_runs_total", "Lease garbage collection passes, by result (success, failure).", "result"),
		gcDur:        NewHistogram("tokenbroker_lease_gc_duration_seconds", "Time of one lease garbage collection pass.", buckets),
		gcLast:       NewGauge("tokenbroker_lease_gc_last_success_timestamp_seconds", "Unix time of the last successful lease garbage collection pass."),
		pendingDel:   NewGauge("tokenbroker_lease_deletions_pending", "Lease deletions (revocations, expired leases, leases of failed requests) that failed and wait for a retry."),
		certExpiry: &expiryCollector{desc: prometheus.NewDesc(
			"tokenbroker_certificate_expiry_timestamp_seconds",
			"NotAfter, as Unix time, of the server certificate (server), the signing CA (ca) and the earliest certificate of the client-CA bundle (client-ca).",
			[]string{"certificate"}, nil)},
		apiErrors:   NewCounterVec("tokenbroker_apiserver_call_errors_total", "Failed Kubernetes API server calls, by call and reason (unavailable, forbidden, not_found, conflict, invalid, other).", "call", "reason"),
		auditEvents: NewCounterVec("tokenbroker_audit_events_total", "Audit events written, by action and decision.", "action", "decision"),
		auditErrors: NewCounter("tokenbroker_audit_write_errors_total", "Audit events that could not be written to the audit sink."),
		buildInfo:   NewGaugeVec("tokenbroker_build_info", "Always 1, labelled with the version, VCS revision and Go version of the running binary.", "version", "revision", "goversion"),
		limited:     NewCounterVec("tokenbroker_limited_total", "Requests refused with 429 by a limit, by peer (empty for enrollments) and reason (issuance_rate, renewal_rate, enrollment_rate, max_live_leases, global_max_live_leases, lease_read_rate, lease_reads_in_flight).", "peer", "reason"),
		unmatched:   NewCounterVec("tokenbroker_unmatched_revocations_total", "Leases revoked because their namespace stopped being covered by their selector grant, by reason (label_changed, namespace_deleted, policy_narrowed, found_at_start, found_by_gc).", "reason"),
		selectorNS:  NewGaugeVec("tokenbroker_selector_namespaces", "Namespaces a grant's namespaceSelector matches now, by peer and grant.", "peer", "grant"),
		poolIssued:  NewCounterVec("tokenbroker_lease_pool_issuances_total", "Token issuances by path: pool (a pre-created lease Secret claimed) or sequential (the Secret created first).", "path"),
		poolReady:   NewGauge("tokenbroker_lease_pool_ready", "Unclaimed pre-created lease Secrets this replica holds."),
	}
	if err := Register(reg, m.issuances, m.issueDur, m.issueOwn, m.apiCall, m.deleted, m.certs, m.reloads, m.revocations,
		m.issuerDur, m.issued, m.requestedTTL, m.grantedTTL, m.clamps, m.denials, m.activeLeases, m.gcRuns, m.gcDur, m.gcLast, m.pendingDel,
		m.certExpiry, m.apiErrors, m.auditEvents, m.auditErrors, m.buildInfo, m.limited, m.unmatched, m.selectorNS,
		m.poolIssued, m.poolReady); err != nil {
		return nil, err
	}
	return m, nil
}

// ttlBuckets cover the TTLs the policy allows: ten minutes (the
// TokenRequest minimum) to a day and more.
var ttlBuckets = []float64{600, 900, 1800, 3600, 2 * 3600, 4 * 3600, 8 * 3600, 12 * 3600, 24 * 3600, 48 * 3600, 7 * 24 * 3600}

func (m *Metrics) ObserveIssue(outcome string, total, own time.Duration) {
	if m == nil {
		return
	}
	m.issuances.WithLabelValues(outcome).Inc()
	m.issueDur.WithLabelValues(outcome).Observe(total.Seconds())
	m.issueOwn.WithLabelValues(outcome).Observe(own.Seconds())
}

func (m *Metrics) ObserveLimited(peer, reason string) {
	if m == nil {
		return
	}
	m.limited.WithLabelValues(peer, reason).Inc()
}

func (m *Metrics) ObserveAPI(call string, d time.Duration) {
	if m == nil {
		return
	}
	m.apiCall.WithLabelValues(call).Observe(d.Seconds())
}

func (m *Metrics) LeaseDeleted(reason string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.deleted.WithLabelValues(reason).Add(float64(n))
}

func (m *Metrics) ObservePoolPath(path string) {
	if m == nil {
		return
	}
	m.poolIssued.WithLabelValues(path).Inc()
}

func (m *Metrics) SetPoolReady(n int) {
	if m == nil {
		return
	}
	m.poolReady.Set(float64(n))
}

func (m *Metrics) SetPendingDeletions(n int) {
	if m == nil {
		return
	}
	m.pendingDel.Set(float64(n))
}

func (m *Metrics) ObserveCertificate(operation, outcome string) {
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

func (m *Metrics) SetRevocations(identities, serials int) {
	if m == nil {
		return
	}
	m.revocations.WithLabelValues("identity").Set(float64(identities))
	m.revocations.WithLabelValues("serial").Set(float64(serials))
}

func (m *Metrics) ObserveIssuer(issuer string, d time.Duration, err error) {
	if m == nil {
		return
	}
	result := "success"
	if err != nil {
		result = "error"
	}
	m.issuerDur.WithLabelValues(issuer, result).Observe(d.Seconds())
}

// observeGrant records a credential handed out: who got it, and how its
// TTL compares with what was asked.
func (m *Metrics) ObserveGrant(peer, namespace, serviceAccount, credential string, requested, granted time.Duration, clampedBy string) {
	if m == nil {
		return
	}
	m.issued.WithLabelValues(peer, namespace, serviceAccount, credential).Inc()
	if requested > 0 {
		m.requestedTTL.Observe(requested.Seconds())
	}
	m.grantedTTL.Observe(granted.Seconds())
	if clampedBy != "" {
		m.clamps.WithLabelValues(clampedBy).Inc()
	}
}

func (m *Metrics) ObserveDenial(action, reason string) {
	if m == nil {
		return
	}
	m.denials.WithLabelValues(action, reason).Inc()
}

// observeGC records one garbage collection pass; active is the number of
// unexpired leases it saw, meaningful only when err is nil.
func (m *Metrics) ObserveGC(d time.Duration, active int, end time.Time, err error) {
	if m == nil {
		return
	}
	m.gcDur.Observe(d.Seconds())
	if err != nil {
		m.gcRuns.WithLabelValues("failure").Inc()
		return
	}
	m.gcRuns.WithLabelValues("success").Inc()
	m.activeLeases.Set(float64(active))
	m.gcLast.Set(float64(end.UnixNano()) / 1e9)
}

// WatchCertificateExpiry reports the NotAfter of one of the broker's
// certificates at every scrape: certificate is CertificateServer,
// CertificateCA or CertificateClientCA, and notAfter returns the NotAfter
// of the certificate in force (zero time: none, not reported), so that a
// reloaded certificate is reported without any callback.
func (m *Metrics) WatchCertificateExpiry(certificate string, notAfter func() time.Time) {
	if m == nil {
		return
	}
	m.certExpiry.mu.Lock()
	defer m.certExpiry.mu.Unlock()
	m.certExpiry.sources = append(m.certExpiry.sources, expirySource{certificate, notAfter})
}

// expiryCollector collects tokenbroker_certificate_expiry_timestamp_seconds
// from the sources registered with WatchCertificateExpiry.
type expiryCollector struct {
	desc    *prometheus.Desc
	mu      sync.Mutex
	sources []expirySource
}

type expirySource struct {
	certificate string
	notAfter    func() time.Time
}

func (c *expiryCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *expiryCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	sources := slices.Clone(c.sources)
	c.mu.Unlock()
	for _, s := range sources {
		if t := s.notAfter(); !t.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(t.Unix()), s.certificate)
		}
	}
}

// SetBuildInfo sets tokenbroker_build_info for the running binary.
func (m *Metrics) SetBuildInfo(version, revision, goVersion string) {
	if m == nil {
		return
	}
	m.buildInfo.Reset()
	m.buildInfo.WithLabelValues(version, revision, goVersion).Set(1)
}

func (m *Metrics) ObserveAPIError(call, reason string) {
	if m == nil {
		return
	}
	m.apiErrors.WithLabelValues(call, reason).Inc()
}

func (m *Metrics) ObserveAudit(action, decision string, writeErr error) {
	if m == nil {
		return
	}
	if writeErr != nil {
		m.auditErrors.Inc()
		return
	}
	m.auditEvents.WithLabelValues(action, decision).Inc()
}

// observeUnmatched counts one lease revoked because its namespace stopped
// being covered, and deleted as lease reason "unmatched".
func (m *Metrics) ObserveUnmatched(reason string) {
	if m == nil {
		return
	}
	m.unmatched.WithLabelValues(reason).Inc()
	m.deleted.WithLabelValues("unmatched").Inc()
}

// PeerGrant names one grant of one peer, as a label pair.
type PeerGrant struct{ Peer, Grant string }

// setSelectorNamespaces replaces the per-grant counts of matching
// namespaces.
func (m *Metrics) SetSelectorNamespaces(counts map[PeerGrant]int) {
	if m == nil {
		return
	}
	m.selectorNS.Reset()
	for k, n := range counts {
		m.selectorNS.WithLabelValues(k.Peer, k.Grant).Set(float64(n))
	}
}
