package broker

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

func newMetricsEnv(t testing.TB) (*env, *prometheus.Registry, *metrics.Metrics) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	e := newEnv(t)
	e.b.cfg.Metrics = m
	return e, reg, m
}

func TestEveryMetricFollowsPrometheusNamingAndHasHelp(t *testing.T) {
	t.Parallel()
	e, reg, m := newMetricsEnv(t)
	m.SetBuildInfo("v1.2.3", "abc", "go1.26")
	m.WatchCertificateExpiry(metrics.CertificateServer, func() time.Time { return time.Unix(2000000000, 0) })
	// Touch every vector so that each has a series to lint.
	_, _ = e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "48h"})
	_, _ = e.b.CollectGarbage(context.Background())
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	require.Empty(t, problems)

	// The package doc on Metrics lists every metric it registers.
	mfs, err := reg.Gather()
	require.NoError(t, err)
	doc := metricsDoc(t)
	for _, mf := range mfs {
		require.Contains(t, doc, mf.GetName(), "Metrics' doc comment does not list %s", mf.GetName())
		require.NotEmpty(t, mf.GetHelp(), mf.GetName())
	}
}

func TestIssuanceMetricsCountWhoGotWhatAndHowTheTTLWasDecided(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	ctx := context.Background()
	issue := func(req apiv1.KubeconfigRequest) error {
		_, err := e.b.IssueKubeconfig(ctx, west, req)
		return err
	}
	require.NoError(t, issue(apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "48h"})) // clamped by the grant
	require.NoError(t, issue(apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h"}))
	require.NoError(t, issue(apiv1.KubeconfigRequest{Namespace: "flux", ServiceAccount: "reader"}))                        // the default TTL
	require.Error(t, issue(apiv1.KubeconfigRequest{Namespace: "kube-system", ServiceAccount: "admin"}))                    // not granted
	require.Error(t, issue(apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", MinTTL: "13h"})) // min_ttl
	require.Error(t, issue(apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "soon"}))   // invalid

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tokenbroker_credentials_issued_total Credentials issued, by peer, namespace, ServiceAccount and credential kind.
# TYPE tokenbroker_credentials_issued_total counter
tokenbroker_credentials_issued_total{credential="token",namespace="argo",peer="west",service_account="admiralty-source"} 2
tokenbroker_credentials_issued_total{credential="token",namespace="flux",peer="west",service_account="reader"} 1
# HELP tokenbroker_ttl_clamps_total Granted TTLs shorter or longer than asked, by the limit that decided (grant.maxTTL, policy.maxTTL, lease.minimum, apiserver, signer).
# TYPE tokenbroker_ttl_clamps_total counter
tokenbroker_ttl_clamps_total{by="grant.maxTTL"} 1
# HELP tokenbroker_denials_total Refused requests, by action (issue, revoke, enroll, renew, authenticate) and reason code.
# TYPE tokenbroker_denials_total counter
tokenbroker_denials_total{action="issue",reason="invalid"} 1
tokenbroker_denials_total{action="issue",reason="min_ttl"} 1
tokenbroker_denials_total{action="issue",reason="not_granted"} 1
`), "tokenbroker_credentials_issued_total", "tokenbroker_ttl_clamps_total", "tokenbroker_denials_total"))

	// Two requests named a TTL (48h and 2h); three were granted 12h, 2h, 1h.
	require.Equal(t, uint64(2), histogramCount(t, reg, "tokenbroker_requested_ttl_seconds"))
	require.InDelta(t, (48+2)*3600.0, histogramSum(t, reg, "tokenbroker_requested_ttl_seconds"), 0.001)
	require.Equal(t, uint64(3), histogramCount(t, reg, "tokenbroker_granted_ttl_seconds"))
	require.InDelta(t, (12+2+1)*3600.0, histogramSum(t, reg, "tokenbroker_granted_ttl_seconds"), 0.001)
	require.Equal(t, 1, seriesCount(t, reg, "tokenbroker_issuer_duration_seconds"), "one series: issuer token, result success")
	require.Equal(t, uint64(3), histogramCountWith(t, reg, "tokenbroker_issuer_duration_seconds", "result", "success"))
}

func TestIssuerAndAPIServerErrorsAreCountedByReason(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	e.iss.err = apierrors.NewServiceUnavailable("etcd is down")
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
	e.iss.err = nil
	e.client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "x", nil)
	})
	_, err = e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Error(t, err)

	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_apiserver_call_errors_total", "call", "issue_token", "reason", "unavailable"))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_apiserver_call_errors_total", "call", "create_lease", "reason", "forbidden"))
	require.Equal(t, 2, seriesCount(t, reg, "tokenbroker_apiserver_call_errors_total"))
	require.Equal(t, uint64(1), histogramCountWith(t, reg, "tokenbroker_issuer_duration_seconds", "result", "error"))
}

func TestGarbageCollectionReportsActiveLeasesAndItsRuns(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	ctx := context.Background()
	for _, ttl := range []string{"10m", "2h", "3h"} {
		_, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: ttl})
		require.NoError(t, err)
	}
	_, err := e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 3.0, metricValue(t, reg, "tokenbroker_leases_active"))

	later := time.Now().Add(11 * time.Minute)
	e.b.cfg.Clock = clocktesting.NewFakeClock(later)
	_, err = e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 2.0, metricValue(t, reg, "tokenbroker_leases_active"))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_leases_deleted_total", "reason", "expired"))
	require.Equal(t, float64(later.UnixNano())/1e9, metricValue(t, reg, "tokenbroker_lease_gc_last_success_timestamp_seconds"))

	e.client.PrependReactor("list", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("down")
	})
	_, err = e.b.CollectGarbage(ctx)
	require.Error(t, err)
	require.Equal(t, 2.0, metricValue(t, reg, "tokenbroker_lease_gc_runs_total", "result", "success"))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_lease_gc_runs_total", "result", "failure"))
	require.Equal(t, 2.0, metricValue(t, reg, "tokenbroker_leases_active"), "a failed pass keeps the last count")
	require.Equal(t, uint64(3), histogramCount(t, reg, "tokenbroker_lease_gc_duration_seconds"))
}

func TestCertificateExpiryIsReadAtEveryScrape(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	notAfter := time.Unix(1900000000, 0)
	m.WatchCertificateExpiry(metrics.CertificateServer, func() time.Time { return notAfter })
	m.WatchCertificateExpiry(metrics.CertificateCA, func() time.Time { return time.Time{} }) // none: not reported
	want := `
# HELP tokenbroker_certificate_expiry_timestamp_seconds NotAfter, as Unix time, of the server certificate (server), the signing CA (ca) and the earliest certificate of the client-CA bundle (client-ca).
# TYPE tokenbroker_certificate_expiry_timestamp_seconds gauge
tokenbroker_certificate_expiry_timestamp_seconds{certificate="server"} %d
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(fmt.Sprintf(want, 1900000000)), "tokenbroker_certificate_expiry_timestamp_seconds"))
	notAfter = time.Unix(1950000000, 0) // a reloaded certificate
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(fmt.Sprintf(want, 1950000000)), "tokenbroker_certificate_expiry_timestamp_seconds"))
}

func TestBuildInfo(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	m.SetBuildInfo("v1.2.3", "abc123", "go1.26.8")
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tokenbroker_build_info Always 1, labelled with the version, VCS revision and Go version of the running binary.
# TYPE tokenbroker_build_info gauge
tokenbroker_build_info{goversion="go1.26.8",revision="abc123",version="v1.2.3"} 1
`), "tokenbroker_build_info"))
}

func TestANilMetricsRecordsNothing(t *testing.T) {
	t.Parallel()
	var m *metrics.Metrics
	// A broker built without metrics (the tests' and the GC replica's)
	// calls every method on nil: each must be a no-op, not a panic.
	for name, call := range map[string]func(){
		"observeGrant":           func() { m.ObserveGrant("p", "ns", "sa", "token", time.Hour, time.Hour, policy.ClampedByGrant) },
		"observeDenial":          func() { m.ObserveDenial(audit.ActionIssue, audit.DenyInvalid) },
		"observeGC":              func() { m.ObserveGC(time.Second, 1, time.Now(), nil) },
		"observeAPIError":        func() { m.ObserveAPIError("x", "other") },
		"observeAudit":           func() { m.ObserveAudit(audit.ActionIssue, audit.DecisionAllow, nil) },
		"observeIssuer":          func() { m.ObserveIssuer("token", time.Second, nil) },
		"WatchCertificateExpiry": func() { m.WatchCertificateExpiry(metrics.CertificateCA, time.Now) },
		"SetBuildInfo":           func() { m.SetBuildInfo("v", "r", "g") },
		"ObserveReload":          func() { m.ObserveReload(metrics.ConfigPolicy, nil) },
	} {
		require.NotPanics(t, call, name)
	}
	// And a whole issuance through a broker without metrics works.
	e := newEnv(t)
	require.Nil(t, e.b.cfg.Metrics)
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
}

func histogramCount(t *testing.T, g prometheus.Gatherer, name string) uint64 {
	t.Helper()
	return histogramCountWith(t, g, name, "", "")
}

// histogramCountWith is the sample count of the series of histogram name
// whose label has value (any series if label is "").
func histogramCountWith(t *testing.T, g prometheus.Gatherer, name, label, value string) uint64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mt := range mf.GetMetric() {
			match := label == ""
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					match = true
				}
			}
			if match {
				n += mt.GetHistogram().GetSampleCount()
			}
		}
	}
	return n
}

// metricsDoc is the source of metrics.go, whose Metrics doc comment lists
// every metric.
func metricsDoc(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("metrics", "metrics.go"))
	require.NoError(t, err)
	s := string(b)
	return s[:strings.Index(s, "type Metrics struct")]
}
