package agent

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// noClusterCAs is a broker that signs no cluster CA (no
// --sign-cluster-cas): it refuses a request with a clusterCACSR whole,
// as POST /v1/certificates does, and renews one without.
type noClusterCAs struct {
	p      *testPKI
	asked  []bool // per request: did it ask for the cluster CA
	status int    // of the refusal; default 422
	field  string // of the refusal; default clusterCACSR
}

func (b *noClusterCAs) Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	b.asked = append(b.asked, req.ClusterCACSR != "")
	if req.ClusterCACSR == "" {
		return b.p.Renew(ctx, req)
	}
	status, field := b.status, b.field
	if status == 0 {
		status = http.StatusUnprocessableEntity
	}
	if field == "" {
		field = "clusterCACSR"
	}
	return nil, &client.ProblemError{Status: status, Problem: apiv1.Problem{
		Title: "Unprocessable", Status: status, Detail: "this broker does not sign cluster CAs",
		Errors: []apiv1.FieldError{{Field: field, Detail: "this broker does not sign cluster CAs (tokenbroker serve --sign-cluster-cas); send the request without it"}},
	}}
}

// clusterCARefusals is the exposition of the refusals counter at n.
func clusterCARefusals(n string) string {
	return `
# HELP tokenbroker_agent_cluster_ca_refusals_total Renewals whose cluster CA the broker refused (it signs none); the client certificate was renewed without it and the pod signer signs nothing until a renewal gets one.
# TYPE tokenbroker_agent_cluster_ca_refusals_total counter
tokenbroker_agent_cluster_ca_refusals_total ` + n + "\n"
}

// TestABrokerThatSignsNoClusterCAStillRenewsTheCertificate: a broker
// without --sign-cluster-cas refuses a renewal that asks for the cluster
// CA; the agent renews its client certificate without it, which every
// target needs, drops the CA (the pod signer waits), logs an error and
// counts it, once per renewal, and asks again at the next one.
func TestABrokerThatSignsNoClusterCAStillRenewsTheCertificate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRenewerFixture(t)
	p := newClusterCAPKI(t, f.clock)
	old := p.identityWithClusterCA(t)
	require.NoError(t, f.store.save(ctx, old))
	f.r.holder.set(old)
	broker := &noClusterCAs{p: p}
	core, logs := observer.New(zap.ErrorLevel)
	f.r.api, f.r.wantClusterCA, f.r.log = broker, true, zap.New(core)
	require.NoError(t, testutil.CollectAndCompare(f.r.metrics.clusterCARefusals, strings.NewReader(clusterCARefusals("0"))))

	due := f.r.step(ctx)
	require.Empty(t, broker.asked, "an identity with its CA renews at its time")
	f.clock.SetTime(due)
	next := f.r.step(ctx)

	require.Equal(t, []bool{true, false}, broker.asked, "asked with the CA, then without")
	cur := f.r.holder.get()
	require.NotEqual(t, old.leaf().SerialNumber, cur.leaf().SerialNumber, "the client certificate was renewed")
	require.Nil(t, f.r.holder.clusterCA(), "the signer has no CA: it waits")
	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, cur.certPEM, stored.certPEM)
	require.Nil(t, stored.clusterCA)
	for _, name := range []string{f.store.dir.ClusterCACert(), f.store.dir.ClusterCAKey()} {
		_, err := os.Stat(name)
		require.ErrorIs(t, err, os.ErrNotExist, "%s is removed", name)
	}
	require.Equal(t, 1.0, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues(resultSuccess)))
	require.Zero(t, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues(resultFailure)), "the renewal did not fail")
	require.NoError(t, testutil.CollectAndCompare(f.r.metrics.clusterCARefusals, strings.NewReader(clusterCARefusals("1"))))
	require.Equal(t, 1, logs.Len(), "one error for the renewal")
	entry := logs.All()[0]
	require.Equal(t, zapcore.ErrorLevel, entry.Level)
	require.Contains(t, entry.Message, "--sign-cluster-cas")
	require.Equal(t, 1, f.calls, "the new certificate went into service")

	// No loop: the next renewal is at the new certificate's time, not at
	// once, though the agent still wants a CA.
	require.True(t, next.After(f.clock.Now()))
	require.Equal(t, next, f.r.step(ctx))
	require.Len(t, broker.asked, 2)

	// It asks again at the next renewal (the broker may sign them by
	// then), and is refused again: one more error, one more count.
	f.clock.SetTime(next)
	f.r.step(ctx)
	require.Equal(t, []bool{true, false, true, false}, broker.asked)
	require.NoError(t, testutil.CollectAndCompare(f.r.metrics.clusterCARefusals, strings.NewReader(clusterCARefusals("2"))))
	require.Equal(t, 2, logs.Len())
}

// TestOnlyTheClusterCAsRefusalRenewsWithoutIt: any other refusal fails the
// renewal as before, and the identity in service keeps its CA.
func TestOnlyTheClusterCAsRefusalRenewsWithoutIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		status int
		field  string
	}{
		{"a 422 on another field", http.StatusUnprocessableEntity, "csr"},
		{"a 400 on the cluster CA's CSR (a bad CSR, not a broker that signs none)", http.StatusBadRequest, "clusterCACSR"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newRenewerFixture(t)
			p := newClusterCAPKI(t, f.clock)
			old := p.identityWithClusterCA(t)
			require.NoError(t, f.store.save(ctx, old))
			f.r.holder.set(old)
			broker := &noClusterCAs{p: p, status: tc.status, field: tc.field}
			f.r.api, f.r.wantClusterCA = broker, true
			f.clock.SetTime(f.r.step(ctx))
			f.r.step(ctx)
			require.Equal(t, []bool{true}, broker.asked, "not asked again without the CA")
			require.Same(t, old, f.r.holder.get(), "the identity in service stays")
			require.NotNil(t, f.r.holder.clusterCA())
			require.Equal(t, 1.0, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues(resultFailure)))
			require.NoError(t, testutil.CollectAndCompare(f.r.metrics.clusterCARefusals, strings.NewReader(clusterCARefusals("0"))))
		})
	}
}

// TestAnAgentThatNoLongerSignsDropsItsClusterCA: an identity with a
// cluster CA in an agent without podSigner renews at once, without asking
// for one, and the stored CA (cluster-ca.crt, cluster-ca.key) is removed.
func TestAnAgentThatNoLongerSignsDropsItsClusterCA(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newRenewerFixture(t)
	p := newClusterCAPKI(t, f.clock)
	old := p.identityWithClusterCA(t)
	require.NoError(t, f.store.save(ctx, old))
	f.r.holder.set(old)
	var asked []string
	f.r.api = renewReqFunc(func(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
		asked = append(asked, req.ClusterCACSR)
		return p.Renew(ctx, req)
	})
	start := f.clock.Now()
	next := f.r.step(ctx)
	require.Equal(t, []string{""}, asked, "renewed in the first step, without asking for a CA")
	require.True(t, f.clock.Now().Equal(start))
	require.True(t, next.After(start))
	require.NotEqual(t, old.leaf().SerialNumber, f.r.holder.get().leaf().SerialNumber)
	require.Nil(t, f.r.holder.clusterCA())
	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Nil(t, stored.clusterCA)
	for _, name := range []string{f.store.dir.ClusterCACert(), f.store.dir.ClusterCAKey()} {
		_, err := os.Stat(name)
		require.ErrorIs(t, err, os.ErrNotExist, "%s is removed", name)
	}
	require.NoError(t, testutil.CollectAndCompare(f.r.metrics.clusterCARefusals, strings.NewReader(clusterCARefusals("0"))), "not a refusal")

	// Then at the new certificate's time, as any identity.
	require.Equal(t, next, f.r.step(ctx))
	require.Len(t, asked, 1)
}
